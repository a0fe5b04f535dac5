"""hvdtrain.data.preparation and .token_files: token files hold today's blocks, are the same
bytes whatever the number of processes, are reused when nothing that decides them changed,
resume after a stop, and a damaged file is a one-line error."""
import logging
import os
import shutil
import zlib
from pathlib import Path

import numpy as np
import pytest

from hvdtrain.config import Config
from hvdtrain.data import build_data, preparation, token_files
from hvdtrain.data.text import builtin_corpus
from hvdtrain.data.token_files import INDEX, TokenStream, token_dtype, write_tokens
from hvdtrain.errors import UserError
from workers.todays_packing import split_documents, todays_blocks

PIECE_CHARS = 20_000  # the builtin corpus (~0.5 MB, some documents longer than that) in ~15 pieces


@pytest.fixture(autouse=True)
def small_pieces(monkeypatch):
    monkeypatch.setattr(preparation, "PIECE_CHARS", PIECE_CHARS)


def config(cache, arch="gpt2", **data) -> Config:
    cfg = Config()
    cfg.model.arch = arch
    cfg.log.progress = False
    for key, value in {"cache_dir": str(cache), "vocab_size": 600, "seq_len": 32, "num_proc": 1,
                       "validation_fraction": 0.1, **data}.items():
        setattr(cfg.data, key, value)
    return cfg


def prepare(cfg) -> Path:
    """Prepare cfg's data; the folder of its token files."""
    plan = preparation.plan(cfg)
    preparation.prepare(plan, num_proc=cfg.data.num_proc, progress=cfg.log.progress)
    return plan.folder


def files(folder: Path) -> dict[str, bytes]:
    """Every file of a prepared folder by relative path (not the temporary files of writes)."""
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*"))
            if p.is_file() and not p.name.startswith(".")}


@pytest.mark.parametrize("arch", ["gpt2", "bert", "llama", "modernbert"])
def test_token_files_give_todays_blocks(tmp_path, arch):
    """The builtin corpus, in pieces tokenized by 2 processes: every block as today's packing
    makes it from the same documents, including blocks that straddle two pieces."""
    cfg = config(tmp_path, arch, num_proc=2)
    data = build_data(cfg, seed=0)
    docs = split_documents(cfg)
    for split, blocks in (("train", data.train), ("validation", data.val)):
        expected = todays_blocks(data.tokenizer, docs[split], arch, cfg.data.seq_len)
        assert len(blocks) == len(expected) > 10
        assert np.array_equal(np.stack([blocks.block(i) for i in range(len(blocks))]), expected), split
        sample = blocks[(7, 0, 3)]
        assert sample["position"] == 7 and sample["input_ids"].tolist() == expected[3].tolist()
    assert len(list((prepare(cfg) / "train").iterdir())) > 10, "many pieces"


def test_any_number_of_processes_writes_the_same_files(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="hvdtrain")
    one = prepare(config(tmp_path, num_proc=1))
    first = files(one)
    shutil.rmtree(one)
    three = prepare(config(tmp_path, num_proc=3))
    assert three == one and files(three) == first
    shutil.rmtree(three)
    prepare(config(tmp_path, num_proc=None))  # the default: the cores this process may use
    assert f"{len(os.sched_getaffinity(0))} tokenizing processes" in caplog.text
    assert files(three) == first


def test_reused_unless_something_that_decides_the_tokens_changed(tmp_path, monkeypatch, caplog):
    caplog.set_level(logging.INFO, logger="hvdtrain")
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n\n".join(builtin_corpus()))
    cfg = config(tmp_path / "cache", source=str(corpus))
    first = build_data(cfg, seed=0)
    assert "cache hit" not in caplog.text

    def no_tokenizing(*args):
        raise AssertionError("tokenized again instead of reading the cache")
    monkeypatch.setattr(preparation, "TokenizingProcesses", no_tokenizing)
    caplog.clear()
    again = build_data(cfg, seed=0)
    assert caplog.text.count("tokens, cache hit") == 2
    assert np.array_equal(again.train.block(5), first.train.block(5))
    # Blocks are cut when read: another sequence length reads the same files.
    longer = build_data(config(tmp_path / "cache", source=str(corpus), seq_len=64), seed=0)
    assert np.array_equal(longer.train.block(1), np.concatenate([first.train.block(2), first.train.block(3)]))

    for changed in (config(tmp_path / "cache", source=str(corpus), vocab_size=500),  # another tokenizer
                    config(tmp_path / "cache", source=str(corpus), max_tokens=10_000),
                    config(tmp_path / "cache", source=str(corpus), validation_fraction=0.2)):
        with pytest.raises(AssertionError, match="tokenized again"):
            build_data(changed, seed=0)
    corpus.write_text(corpus.read_text()[:200_000])  # another corpus
    with pytest.raises(AssertionError, match="tokenized again"):
        build_data(cfg, seed=0)


def test_a_stopped_preparation_is_never_read_and_resumes(tmp_path, caplog):
    """What a preparation killed half way leaves: some pieces done, one token file written
    without its record, a temporary file, no index. The next one does the rest, and the result
    is the same files."""
    folder = prepare(config(tmp_path))
    complete = files(folder)
    (folder / INDEX).unlink()
    records = sorted((folder / "pieces").glob("*.json"))
    for record in records[len(records) // 2:]:
        record.unlink()
        (folder / "train" / f"{record.stem}.bin").unlink()
    (folder / "pieces" / records[-1].name).unlink(missing_ok=True)
    (folder / "train" / f".{records[-1].stem}.bin.tmp-123-abcd").write_bytes(b"half written")
    kept = (folder / "train" / f"{records[0].stem}.bin").stat().st_mtime_ns

    caplog.set_level(logging.INFO, logger="hvdtrain")
    data = build_data(config(tmp_path), seed=0)
    assert "tokens, prepared" in caplog.text and "tokens, cache hit" not in caplog.text
    assert files(folder) == complete
    assert (folder / "train" / f"{records[0].stem}.bin").stat().st_mtime_ns == kept, "done pieces are not redone"
    assert len(data.train) > 0


def flip_a_byte(path: Path):
    data = path.read_bytes()
    path.write_bytes(data[:100] + bytes([data[100] ^ 4]) + data[101:])


@pytest.mark.parametrize("damage,message", [
    (lambda path: path.write_bytes(path.read_bytes()[:-2]), "is truncated or was overwritten"),
    (lambda path: path.unlink(), "is missing"),
], ids=["truncated", "missing"])
def test_a_start_refuses_a_file_of_the_wrong_size_with_one_line(tmp_path, damage, message):
    folder = prepare(config(tmp_path))
    victim = sorted((folder / "validation").iterdir())[-1]
    damage(victim)
    with pytest.raises(UserError) as error:
        build_data(config(tmp_path), seed=0)
    assert_names(error.value, victim, message, folder)


def assert_names(error: UserError, victim: Path, message: str, folder: Path):
    assert f"token file {victim} " in str(error) and message in str(error)
    assert f"delete {folder} and prepare the data again" in str(error)
    assert "\n" not in str(error)


def test_a_start_reads_the_checksums_of_a_sample_only(tmp_path, monkeypatch):
    """At terabytes, reading every token file at every start (every rank, every elastic reset)
    would take hours: a start reads SAMPLED_PIECES pieces of each split for their checksums."""
    folder = prepare(config(tmp_path))
    sizes = {split: sorted(p.stat().st_size for p in (folder / split).iterdir()) for split in preparation.SPLITS}
    assert min(len(s) for s in sizes.values()) > 3 * token_files.SAMPLED_PIECES
    read = []
    crc32 = zlib.crc32
    monkeypatch.setattr(zlib, "crc32", lambda data, value=0: read.append(len(data)) or crc32(data, value))
    for _ in range(3):
        read.clear()
        build_data(config(tmp_path), seed=0)
        assert 0 < sum(read) <= sum(sum(s[-token_files.SAMPLED_PIECES:]) for s in sizes.values())


def test_a_flipped_byte_is_found_by_the_full_verification(tmp_path):
    folder = prepare(config(tmp_path))
    victim = sorted((folder / "train").iterdir())[-1]
    flip_a_byte(victim)
    cfg = config(tmp_path)
    with pytest.raises(UserError) as error:
        preparation.prepare(preparation.plan(cfg), num_proc=1, progress=False, verify=True)
    assert_names(error.value, victim, "does not match its recorded checksum: it is corrupt", folder)
    # Two members sharing the reading: the one whose share holds the file finds it.
    found = []
    for member in (0, 1):
        try:
            token_files.verify_pieces(folder, preparation.read_index(folder), member, 2)
        except UserError:
            found.append(member)
    assert len(found) == 1


def test_a_preparation_reads_back_the_pieces_an_earlier_one_left(tmp_path):
    """The full check of a preparation: a piece a stopped preparation finished, damaged since,
    stops the next one before the index calls the folder complete."""
    folder = prepare(config(tmp_path))
    (folder / INDEX).unlink()
    victim = folder / "train" / "train-000003.bin"
    flip_a_byte(victim)
    with pytest.raises(UserError) as error:
        prepare(config(tmp_path))
    assert_names(error.value, victim, "it is corrupt", folder)
    assert not (folder / INDEX).exists()


def test_max_tokens_and_max_documents_cut_deliberately(tmp_path):
    whole = prepare(config(tmp_path))
    uncut = files(whole)
    for num_proc in (1, 2):
        cut = prepare(config(tmp_path, max_tokens=20_000, num_proc=num_proc))
        index = preparation.read_index(cut)
        assert index["splits"]["train"]["tokens"] == 20_000
        kept = files(cut)
        pieces = [f for f in kept if f.startswith("train/")]
        assert 1 < len(pieces) < len([f for f in uncut if f.startswith("train/")])
        assert all(kept[f] == uncut[f] for f in kept if f.endswith(".bin")), "the uncut files' first pieces"
        shutil.rmtree(cut)
    data = build_data(config(tmp_path, max_tokens=20_000), seed=0)
    assert len(data.train) == 20_000 // 32
    few = preparation.read_index(prepare(config(tmp_path, max_documents=20)))
    assert few["splits"]["train"]["documents"] + few["splits"]["validation"]["documents"] == 20


def test_token_stream_reads_across_pieces_in_either_width(tmp_path):
    assert token_dtype(65_536) == np.dtype("<u2") and token_dtype(65_537) == np.dtype("<u4")
    pieces = [np.arange(start, start + n, dtype="<u4") for start, n in ((70_000, 5), (80_000, 3), (90_000, 7))]
    paths = [tmp_path / f"{i}.bin" for i in range(3)]
    for path, piece in zip(paths, pieces):
        assert write_tokens(path, [piece[:2], piece[2:]])[0] == len(piece)
    stream = TokenStream(paths, [5, 3, 7], "<u4")
    whole = np.concatenate(pieces)
    assert len(stream) == 15
    for start in range(15):
        for count in range(1, 16 - start):
            assert stream.read(start, count).tolist() == whole[start:start + count].tolist()
    with pytest.raises(IndexError):
        stream.read(10, 6)


def test_the_progress_bar_shows_documents_and_tokens_per_second(tmp_path, monkeypatch, caplog, capsys):
    monkeypatch.setattr(preparation, "PROGRESS_DELAY_S", 0)
    monkeypatch.setattr(preparation, "on_terminal", lambda stream: True)  # the bar is drawn on terminals only
    caplog.set_level(logging.INFO, logger="hvdtrain")
    cfg = config(tmp_path)
    cfg.log.progress = True
    prepare(cfg)
    bar = capsys.readouterr().err
    assert "preparing" in bar and "docs/s" in bar and "tokens/s" in bar


def test_too_little_text_for_one_block_names_source_and_seq_len(tmp_path):
    corpus = tmp_path / "tiny.txt"
    corpus.write_text("\n\n".join(f"Short document number {i}." for i in range(40)))
    with pytest.raises(UserError, match=rf"data.source '{corpus}': the train text is shorter .*data.seq_len=512"):
        build_data(config(tmp_path, source=str(corpus), seq_len=512), seed=0)


def test_causal_lm_needs_a_tokenizer_with_eos(tmp_path):
    bert = build_data(config(tmp_path, "bert"), seed=0).tokenizer
    bert.save_pretrained(tmp_path / "bert-tokenizer")
    with pytest.raises(UserError, match="data.tokenizer.*eos_token"):
        preparation.plan(config(tmp_path, tokenizer=str(tmp_path / "bert-tokenizer")))
