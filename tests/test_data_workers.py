"""Preparation and training from token files with real processes: two horovodrun workers write
the files one process writes, a preparation killed half way is never taken for complete,
damaged token files are refused with one line and exit code 2, and training from
the token files is training from today's in-memory blocks."""
import logging
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from helpers import BIN, OFFLINE, WORKERS, assert_same_losses, horovodrun, hvdtrain, run_cmd, step_losses
from hvdtrain.config import load_config
from hvdtrain.data import build_data, preparation
from hvdtrain.data.text import builtin_corpus

pytestmark = pytest.mark.workers

PIECES = "20000"  # characters per piece: the builtin corpus in ~15 pieces
TEXT = {"data": {"source": "builtin", "vocab_size": 600, "seq_len": 32, "validation_fraction": 0.1,
                 "tokenizer_sample_mb": 0.5},
        "train": {"max_steps": 4}, "eval": {"batches": 1}}


def prepare_alone(config, cache: Path, *overrides, pieces=PIECES):
    proc = run_cmd([sys.executable, WORKERS / "prepare_pieces.py", pieces, config, f"data.cache_dir={cache}",
                    "data.num_proc=1", *overrides])
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    return prepared_folder(cache)


def prepared_folder(cache: Path) -> Path:
    (folder,) = (cache / "tokenized").iterdir()
    return folder


def files(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*"))
            if p.is_file() and not p.name.startswith(".") and ".hosts" not in p.parts}


def test_two_horovod_workers_write_the_files_one_process_writes(tmp_path, tiny_config):
    config = tiny_config(TEXT)
    alone = prepare_alone(config, tmp_path / "alone")
    shutil.copytree(tmp_path / "alone" / "tokenizers", tmp_path / "pair" / "tokenizers")
    proc = horovodrun(2, [WORKERS / "prepare_pieces.py", PIECES, config, f"data.cache_dir={tmp_path / 'pair'}",
                          "data.num_proc=1"])
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "1 tokenizing processes x 2 workers" in proc.stdout
    pair = prepared_folder(tmp_path / "pair")
    assert pair.name == alone.name and len(files(alone)) > 20
    assert files(pair) == files(alone)


@pytest.mark.deep
def test_workers_that_see_the_max_tokens_cut_at_different_pieces_write_the_one_process_files(tmp_path,
                                                                                              tiny_config):
    """data.max_tokens cuts the training split inside piece 2 or so of ~15. Member 1 starts only
    once member 0 has tokenized all its pieces: member 0 never saw the cut reached (member 1's
    pieces were missing) and read to the end, while member 1 sees it after a few pieces and
    stops without tokenizing its later ones."""
    config = tiny_config(TEXT)
    cut = ("data.max_tokens=20000",)
    alone = prepare_alone(config, tmp_path / "alone", *cut)
    shutil.copytree(tmp_path / "alone" / "tokenizers", tmp_path / "pair" / "tokenizers")
    proc = horovodrun(2, [WORKERS / "prepare_pieces.py", PIECES, config, f"data.cache_dir={tmp_path / 'pair'}",
                          "data.num_proc=1", *cut], env={"PREPARE_AFTER_MEMBER_0": str(tmp_path / "member-0-done")})
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    pair = prepared_folder(tmp_path / "pair")
    assert pair.name == alone.name and 1 < len(list((alone / "train").iterdir())) < 10
    assert files(pair) == files(alone)


def test_a_killed_preparation_is_never_taken_for_complete(tmp_path, tiny_config, monkeypatch, caplog):
    config = tiny_config({**TEXT, "data": {**TEXT["data"], "source": str(tmp_path / "corpus.txt")}})
    (tmp_path / "corpus.txt").write_text("\n\n".join(builtin_corpus() * 4))  # ~2 MB
    cache = tmp_path / "cache"
    proc = subprocess.Popen([sys.executable, WORKERS / "prepare_pieces.py", PIECES, config, f"data.cache_dir={cache}",
                             "data.num_proc=1"], env={**os.environ, **OFFLINE}, start_new_session=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    while len(list(cache.glob("tokenized/*/pieces/*.json"))) < 3:
        assert proc.poll() is None and time.monotonic() < deadline, "the preparation ended before it was killed"
        time.sleep(0.01)
    os.killpg(proc.pid, signal.SIGKILL)  # the preparation and its tokenizing processes
    proc.wait()
    folder = prepared_folder(cache)
    assert not (folder / "index.json").exists()

    # What training does next (with the same piece size): prepare the rest, then read.
    monkeypatch.setattr(preparation, "PIECE_CHARS", int(PIECES))
    caplog.set_level(logging.INFO, logger="hvdtrain")
    data = build_data(load_config(str(config), [f"data.cache_dir={cache}"]), seed=0)
    assert "tokens, prepared" in caplog.text and "tokens, cache hit" not in caplog.text
    assert len(data.train) > 1000
    shutil.copytree(cache / "tokenizers", tmp_path / "clean" / "tokenizers")
    assert files(prepare_alone(config, tmp_path / "clean")) == files(folder)


def test_damaged_token_files_are_refused_with_one_line(tmp_path, tiny_config):
    """(Every kind of damage is checked in test_data_prepare.py; here the commands' answers.)
    A start checks sizes and a sample of checksums: a truncated file stops `hvdtrain train`. A
    flipped byte keeps the size: `hvdtrain prepare --verify` reads every file and finds it, also
    when horovodrun's workers share the reading."""
    config = tiny_config(TEXT)
    cache = f"data.cache_dir={tmp_path / 'cache'}"
    folder = prepare_alone(config, tmp_path / "cache", pieces=str(preparation.PIECE_CHARS))  # as train cuts them
    proc = horovodrun(2, [BIN / "hvdtrain", "prepare", "--verify", config, cache])
    assert proc.returncode == 0 and "verified every token file" in proc.stdout + proc.stderr, proc.stderr[-2000:]

    piece = folder / "train" / "train-000000.bin"
    data = piece.read_bytes()
    piece.write_bytes(data[:100] + bytes([data[100] ^ 4]) + data[101:])
    proc = hvdtrain("prepare", "--verify", config, cache)
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert proc.stderr.startswith(f"hvdtrain: error: token file {piece} does not match its recorded checksum")
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr

    piece.write_bytes(data[:-2])
    proc = hvdtrain("train", config, cache, f"out_dir={tmp_path / 'run'}")
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert proc.stderr.startswith(f"hvdtrain: error: token file {piece} has {len(data) - 2} bytes")
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr


def test_training_from_token_files_is_training_from_todays_blocks(tmp_path, tiny_config):
    config = tiny_config({**TEXT, "eval": {"every": 2, "batches": 2}})
    cache = f"data.cache_dir={tmp_path / 'cache'}"
    files_run = hvdtrain("train", config, cache, f"out_dir={tmp_path / 'files'}", timeout=400)
    assert files_run.returncode == 0, files_run.stdout[-2000:] + files_run.stderr[-2000:]
    todays = run_cmd([sys.executable, WORKERS / "train_on_todays_blocks.py", config, cache,
                      f"out_dir={tmp_path / 'today'}"], timeout=400)
    assert todays.returncode == 0, todays.stdout[-2000:] + todays.stderr[-2000:]
    assert_same_losses(step_losses(tmp_path / "files"), step_losses(tmp_path / "today"), min_steps=4)
