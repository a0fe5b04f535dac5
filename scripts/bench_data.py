"""Benchmark of data preparation: hvdtrain's token files against the obvious approach.

    .venv/bin/python scripts/bench_data.py --mb 100,1000 [--dir /tmp/hvdtrain-bench-data] [--json]

For each size it generates a corpus of that many megabytes of text (once; kept in --dir, never
in the repository), then runs every case in a fresh process of the gpt-tiny recipe and samples
the memory of that process and all its children every 0.1 s:

  tokenizer   training the BPE tokenizer on its bounded sample (data.tokenizer_sample_mb)
  prepare 1   hvdtrain's preparation with 1 tokenizing process (the tokenizer cached)
  prepare 2   the same with 2 processes
  baseline 2  the obvious way, as hvdtrain did before: datasets.map over the corpus in 2
              processes, kept in memory, then np.concatenate of the token lists into one array
  train       10 steps of `hvdtrain train` reading the prepared token files (and checking them)

and prints what each case used (see `measure`: peak RSS of its processes added up, the largest
one), its wall and CPU time and tokens per second and per CPU-second, both counted after its
imports, from reading the text to the last token (training: the whole run). On a machine
shared with other work the wall times vary with its load (printed); the CPU times do not. Targets: preparing 1 GB in less than
1 GB and within 10% of preparing 100 MB; training memory the same for every size; 2 processes
at least 1.7x as fast as 1.
"""
import argparse
import json
import os
import re
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import psutil

REPO = Path(__file__).resolve().parent.parent
RECIPE = REPO / "recipes" / "gpt-tiny.yaml"
RESULT_TAG = "bench_data result: "


# ---------------------------------------------------------------- the corpus

def generate_corpus(path: Path, megabytes: int, seed: int = 0):
    """English-like text: words of the builtin corpus by their frequency, then a long tail of
    made-up words of 2-4 syllables (Zipf-distributed, as in real text, so the tokenizer's word
    cache and BPE training see realistic variety), in sentences of 5-30 words and paragraphs
    (documents) of 2-12 sentences separated by blank lines."""
    from collections import Counter

    from pydoc_data.topics import topics

    rng = np.random.default_rng(seed)
    counts = Counter(re.findall(r"[a-z]{2,}", " ".join(topics.values()).lower()))
    words = [w for w, _ in counts.most_common()]
    syllables = sorted({w[i:i + 3] for w in words for i in range(0, len(w) - 2, 3)})
    picks, lengths = rng.integers(0, len(syllables), size=(200_000, 4)), rng.integers(2, 5, size=200_000)
    made_up = ["".join(syllables[j] for j in row[:n]) for row, n in zip(picks, lengths)]
    vocab = np.array(list(dict.fromkeys(words + made_up)))
    cdf = np.cumsum(1.0 / (np.arange(len(vocab)) + 10.0) ** 1.1)
    cdf /= cdf[-1]
    tmp, written = path.with_suffix(".tmp"), 0
    with open(tmp, "w") as f:
        while written < megabytes * 1_000_000:
            drawn = vocab[np.minimum(np.searchsorted(cdf, rng.random(200_000)), len(vocab) - 1)]
            sentences = [" ".join(s).capitalize() + "." for s in
                         np.split(drawn, np.cumsum(rng.integers(5, 30, size=20_000)))[:-1] if len(s)]
            cuts = np.cumsum(rng.integers(2, 12, size=len(sentences)))
            docs = [" ".join(d) for d in np.split(np.array(sentences, dtype=object), cuts) if len(d)]
            chunk = "\n\n".join(docs) + "\n\n"
            f.write(chunk)
            written += len(chunk)
    tmp.rename(path)


# ---------------------------------------------------------------- the cases (each in its own process)

def case_config(corpus: str, cache: str, num_proc: int):
    from hvdtrain.config import load_config
    return load_config(str(RECIPE), [f"data.source={corpus}", f"data.cache_dir={cache}", f"data.num_proc={num_proc}",
                                     "data.validation_fraction=0.01", "log.progress=false"])


def case_tokenizer(cfg) -> dict:
    from hvdtrain.data import preparation
    preparation.plan(cfg)  # trains the tokenizer on its sample, caches it
    return {"tokens": 0}


def case_prepare(cfg) -> dict:
    from hvdtrain.data import preparation
    index = preparation.prepare(preparation.plan(cfg), num_proc=cfg.data.num_proc, progress=False)
    return {"tokens": sum(split["tokens"] for split in index["splits"].values())}


def case_baseline(cfg) -> dict:
    """What hvdtrain did before token files (and what most scripts do): convert the text to a
    `datasets` table, tokenize it with datasets.map in num_proc processes, keep the result in
    memory, and np.concatenate the documents' token lists into one array cut into blocks."""
    import datasets

    from hvdtrain.data import preparation

    tokenizer = preparation.plan(cfg).tokenizer
    texts = datasets.load_dataset("text", data_files=[cfg.data.source], split="train", sample_by="paragraph",
                                  cache_dir=str(Path(cfg.data.cache_dir) / "baseline-datasets"))

    def tokenize(batch):
        ids = tokenizer(batch["text"], add_special_tokens=False, return_attention_mask=False)["input_ids"]
        return {"input_ids": [doc + [tokenizer.eos_token_id] for doc in ids]}

    tokens = texts.map(tokenize, batched=True, num_proc=cfg.data.num_proc, remove_columns=["text"],
                       keep_in_memory=True)
    column = tokens.data.column("input_ids")
    stream = np.concatenate([chunk.values.to_numpy() for chunk in column.chunks])
    blocks = stream[:len(stream) // cfg.data.seq_len * cfg.data.seq_len].reshape(-1, cfg.data.seq_len)
    return {"tokens": len(stream), "blocks": len(blocks)}


CASES = {"tokenizer": case_tokenizer, "prepare": case_prepare, "baseline": case_baseline}


def run_case(kind: str, corpus: str, cache: str, num_proc: int):
    import datasets  # noqa: F401  (imports are not timed: they take seconds on a busy machine)

    from hvdtrain.data import preparation  # noqa: F401

    cfg = case_config(corpus, cache, num_proc)
    start, cpu = time.perf_counter(), _cpu_seconds()
    result = CASES[kind](cfg)
    result.update(seconds=time.perf_counter() - start, work_cpu_s=_cpu_seconds() - cpu)
    print(RESULT_TAG + json.dumps(result), flush=True)


def _cpu_seconds() -> float:
    """CPU time of this process and of the processes it started and waited for (the tokenizing
    processes, datasets.map's pool)."""
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


# ---------------------------------------------------------------- measuring

def measure(cmd: list[str]) -> dict:
    """Run `cmd`; its result line and what it used, it and every process it started:
    peak_rss_mb   each process's peak RSS (the kernel's high-water mark) added up: an upper
                  bound of the memory the case held at once;
    largest_mb    the peak RSS of the largest process;
    cpu_s         CPU seconds, user + system, all processes;
    wall_s, load  wall time, and the machine's load average when it started (other work on a
                  shared machine slows the wall time, not the CPU time)."""
    load = float(open("/proc/loadavg").read().split()[0])
    start = time.perf_counter()
    log = tempfile.TemporaryFile("w+")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, text=True, cwd=REPO,
                            env={**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"})
    root, peaks = psutil.Process(proc.pid), {}
    while True:
        pid, status, usage = os.wait4(proc.pid, os.WNOHANG)  # usage covers the processes it waited for
        if pid:
            break
        for p in [root, *root.children(recursive=True)]:
            try:
                peaks[p.pid] = max(peaks.get(p.pid, 0), _high_water_mark(p.pid))
            except (FileNotFoundError, ProcessLookupError, psutil.NoSuchProcess):
                pass  # it ended between listing and reading
        time.sleep(0.05)
    proc.returncode = os.waitstatus_to_exitcode(status)
    log.seek(0)
    text = log.read()
    if proc.returncode:
        raise RuntimeError(f"{' '.join(map(str, cmd))} failed ({proc.returncode}):\n{text[-3000:]}")
    lines = [line.split(RESULT_TAG, 1)[1] for line in text.splitlines() if RESULT_TAG in line]
    result = json.loads(lines[0]) if lines else {}
    return {**result, "wall_s": time.perf_counter() - start, "cpu_s": usage.ru_utime + usage.ru_stime,
            "peak_rss_mb": sum(peaks.values()) / 1e3, "largest_mb": usage.ru_maxrss / 1e3, "load": load}


def _high_water_mark(pid: int) -> int:
    """VmHWM of a process, in kB (0 once it has exited: a zombie has no memory left)."""
    with open(f"/proc/{pid}/status") as f:
        return next((int(line.split()[1]) for line in f if line.startswith("VmHWM:")), 0)


def bench_size(megabytes: int, folder: Path) -> list[dict]:
    corpus = folder / f"corpus-{megabytes}mb.txt"
    if not corpus.exists():
        print(f"generating {corpus} ...", flush=True)
        generate_corpus(corpus, megabytes)
    cache = folder / f"cache-{megabytes}mb"
    shutil.rmtree(cache, ignore_errors=True)
    me = [sys.executable, str(Path(__file__).resolve()), "_case"]
    rows = []
    for name, kind, num_proc in (("tokenizer", "tokenizer", 1), ("prepare 1", "prepare", 1),
                                 ("prepare 2", "prepare", 2), ("baseline 2", "baseline", 2)):
        if kind == "prepare":
            shutil.rmtree(cache / "tokenized", ignore_errors=True)
        print(f"{megabytes} MB: {name} ...", flush=True)
        rows.append({"mb": megabytes, "case": name, **measure([*me, kind, str(corpus), str(cache), str(num_proc)])})
    print(f"{megabytes} MB: train ...", flush=True)
    train = measure([sys.executable, "-m", "hvdtrain.cli", "train", str(RECIPE), f"data.source={corpus}",
                     f"data.cache_dir={cache}", "data.validation_fraction=0.01", "train.max_steps=10",
                     "train.global_batch_size=8", "train.warmup_steps=2", "eval.batches=2", "checkpoint.every=0",
                     "log.progress=false", "log.tensorboard=false", f"out_dir={folder / 'run'}"])
    shutil.rmtree(folder / "run", ignore_errors=True)
    rows.append({"mb": megabytes, "case": "train 10 steps", **train})
    return rows


def print_table(rows: list[dict]):
    print(f"\n{'corpus':>8} {'case':<15} {'peak RSS':>9} {'largest':>8} {'wall':>7} {'CPU':>7} {'tokens/s':>9} "
          f"{'per CPU-s':>9} {'load':>5}")
    for r in rows:
        speed = (f"{r['tokens'] / r['seconds'] / 1e3:>8.0f}k {r['tokens'] / r['work_cpu_s'] / 1e3:>8.0f}k"
                 if r.get("tokens") else f"{'':>9} {'':>9}")
        print(f"{r['mb']:>5} MB {r['case']:<15} {r['peak_rss_mb']:>6.0f} MB {r['largest_mb']:>5.0f} MB "
              f"{r.get('seconds', r['wall_s']):>6.0f}s {r.get('work_cpu_s', r['cpu_s']):>6.0f}s {speed} "
              f"{r['load']:>5.1f}")
    by = {(r["mb"], r["case"]): r for r in rows}
    sizes = sorted({r["mb"] for r in rows})
    for mb in sizes:
        one, two, base = by[(mb, "prepare 1")], by[(mb, "prepare 2")], by[(mb, "baseline 2")]
        print(f"{mb} MB: 2 processes {one['seconds'] / two['seconds']:.2f}x as fast as 1 (wall), with "
              f"{two['work_cpu_s'] / one['work_cpu_s']:.2f}x its CPU time; preparing's peak RSS is "
              f"{two['peak_rss_mb'] / base['peak_rss_mb']:.0%} of the baseline's")
    for case in ("prepare 1", "prepare 2", "train 10 steps"):
        small, large = by[(sizes[0], case)], by[(sizes[-1], case)]
        print(f"{case}: peak RSS {large['peak_rss_mb'] / small['peak_rss_mb'] - 1:+.0%} from {sizes[0]} MB to "
              f"{sizes[-1]} MB")


def main():
    if len(sys.argv) > 1 and sys.argv[1] == "_case":
        kind, corpus, cache, num_proc = sys.argv[2:6]
        return run_case(kind, corpus, cache, int(num_proc))
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mb", default="100,1000", help="corpus sizes in MB, comma-separated (default 100,1000)")
    parser.add_argument("--dir", default=str(Path(tempfile.gettempdir()) / "hvdtrain-bench-data"),
                        help="where the generated corpora and caches go (not the repository)")
    parser.add_argument("--json", action="store_true", help="print the rows as JSON too")
    args = parser.parse_args()
    folder = Path(args.dir)
    folder.mkdir(parents=True, exist_ok=True)
    rows = [row for mb in args.mb.split(",") for row in bench_size(int(mb), folder)]
    print_table(rows)
    if args.json:
        print(json.dumps(rows))


if __name__ == "__main__":
    main()
