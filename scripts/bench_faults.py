"""Fault campaign: a real `hvdtrain launch` hit by many randomised faults, one after another,
relaunched after each until it reaches its last step; then compared with an uninterrupted run.

    .venv/bin/python scripts/bench_faults.py --layout plain --faults 30 --seed 1 [--json]
    .venv/bin/python scripts/bench_faults.py --layout pipeline --faults 30 --seed 2
    .venv/bin/python scripts/bench_faults.py --layout elastic --faults 30 --seed 3

The faults, drawn from the seed (kind, and the step at which each lands):
  kill-worker       SIGKILL of one worker
  kill-all          SIGKILL of every worker
  kill-launcher     SIGKILL of `hvdtrain launch` alone: its workers must stop by themselves within
                    seconds (none may go on beside the relaunched job)
  kill-in-write     SIGKILL of every worker inside a checkpoint write: before its manifest, or after
                    the manifest and before the rename into place (the write pauses there: the test aid
                    HVDTRAIN_TEST_CHECKPOINT_PAUSE)
  kill-in-rewrite   SIGKILL of every worker inside the rewrite of a step whose checkpoint folder is
                    there already, between its two renames (the old version moved aside, the new one
                    not yet in place). A rerun resumes from the newest checkpoint, so to redo a step
                    that has one the campaign hides it (and any newer one) while the launch decides
                    where to resume, then puts it back (as when a run goes back to an earlier
                    checkpoint, or an elastic job rolls back past one)
  preempt           SIGTERM or SIGUSR1 to one worker: the run checkpoints and exits 75
  write-failure     the launch runs under a file-size limit smaller than a checkpoint: the write fails
  damage            between two launches the newest checkpoint is truncated or has a byte flipped
                    (only when an older one is there to go back to)
  elastic-kill      (--layout elastic) SIGKILL of one worker; the job goes on without a relaunch and
                    the lost host comes back after Horovod's blacklist cooldown

Every launch uses Gloo (elastic jobs need it, and a file-size limit would also stop Open MPI's own
shared-memory files). At the end, against an uninterrupted run of the same command: the per-step losses of the final
history and the exported parameters must be equal (bitwise where the layout is deterministic, else
within --rtol), every step must appear once in metrics.jsonl, no `.tmp-`/`.old-` folder and no
worker process may be left, and the exported model must load with transformers. It prints a table
of faults by kind, relaunches, steps recomputed, checkpoints set aside, and anything lost.
"""
import argparse
import json
import os
import random
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import psutil

REPO = Path(__file__).resolve().parent.parent
RECIPE = REPO / "recipes" / "gpt-tiny.yaml"
HVDTRAIN = Path(sys.executable).parent / "hvdtrain"
KINDS = {"plain": ["kill-worker", "kill-all", "kill-launcher", "kill-in-write", "kill-in-rewrite", "preempt",
                   "write-failure", "damage"],
         "elastic": ["elastic-kill"]}
KINDS["pipeline"] = KINDS["plain"]
CHECKPOINT_EVERY = 4
ORPHAN_GRACE_S = 15  # how long the workers of a killed launcher may take to stop


def run_overrides(out: Path, steps: int, layout: str) -> list[str]:
    """The campaign's run: gpt-tiny, one record per step, a checkpoint every 4 steps."""
    over = [f"out_dir={out}", f"train.max_steps={steps}", "train.warmup_steps=4", f"checkpoint.every={CHECKPOINT_EVERY}",
            "checkpoint.keep=3", "log.every=1", "log.progress=false", "eval.every=0", "eval.batches=2"]
    if layout == "pipeline":
        over.append("parallel.pipeline_stages=2")
    if layout == "elastic":  # slower steps: a lost host takes tens of seconds to come back and join
        over += ["train.slow_ranks=[0,1]", "train.slow_seconds=0.2"]
    return over


def discovery_script(folder: Path) -> Path:
    """Two one-slot hosts (Horovod blacklists per host), both this machine."""
    script = folder / "discover.sh"
    script.write_text("#!/bin/sh\necho localhost:1\necho 127.0.0.1:1\n")
    script.chmod(0o755)
    return script


def launch_command(folder: Path, layout: str, config_args: list[str]) -> list[str]:
    cmd = [str(HVDTRAIN), "launch", "-np", "2", "--gloo"]
    if layout == "elastic":
        cmd += ["--elastic", "--min-np", "1", "--max-np", "2", "--host-discovery-script",
                str(discovery_script(folder)), "--network-interface", "lo", "--blacklist-cooldown-range", "1", "2"]
    return cmd + [str(RECIPE), *config_args]


def workers_of(out: Path) -> list[psutil.Process]:
    """Every live training worker of this run folder, whoever started it."""
    found = []
    for p in psutil.process_iter(["cmdline"]):
        cmd = p.info["cmdline"] or []
        if cmd[1:4] == ["-m", "hvdtrain.cli", "train"] and f"out_dir={out}" in cmd:
            found.append(p)
    return found


def metrics_lines(out: Path) -> list[str]:
    path = out / "metrics.jsonl"
    return path.read_text().splitlines() if path.exists() else []


def train_records(out: Path, lines: list[str] | None = None) -> list[dict]:
    """metrics.jsonl's training records as written, duplicates included (a reader's view)."""
    records = []
    for line in metrics_lines(out) if lines is None else lines:
        try:
            record = json.loads(line)
        except ValueError:
            continue  # a line cut by a kill: counted by the final check
        if "loss" in record and "event" not in record:
            records.append(record)
    return records


def step_reached(out: Path, before: set[str] = frozenset()) -> int:
    """The last step logged, in the lines not in `before` (what the file held when a launch began:
    until it opens its run log, a relaunch still finds the records of steps it will redo)."""
    return max((r["step"] for r in train_records(out, [line for line in metrics_lines(out) if line not in before])),
               default=0)


def checkpoints(out: Path) -> list[Path]:
    root = out / "checkpoints"
    return sorted(root.glob("step_*")) if root.is_dir() else []


def step_of(path: Path) -> int:
    return json.loads((path / "state.json").read_text())["step"]


class Campaign:
    def __init__(self, folder: Path, layout: str, kinds: list[str], faults: int, seed: int, steps: int):
        self.folder, self.layout, self.kinds, self.faults = folder, layout, kinds, faults
        self.rng = random.Random(seed)
        self.steps = steps
        self.out = folder / "run"
        self.cache = folder / "cache"
        self.injected = Counter()
        self.relaunches = 0
        self.recomputed = 0
        self.findings: list[str] = []  # what went wrong: each one is a defect
        self.log = open(folder / "launches.log", "w")
        self.lines_before: set[str] = set()  # metrics.jsonl's lines when the current launch began
        self.writes_before: set[tuple[Path, int]] = set()  # and the checkpoint writes left in flight

    def command(self, out: Path) -> list[str]:
        return launch_command(self.folder, self.layout, [*run_overrides(out, self.steps, self.layout),
                                                         f"data.cache_dir={self.cache}"])

    def start(self, env: dict | None = None, fsize: int | None = None) -> subprocess.Popen:
        def limit():
            if fsize is not None:
                resource.setrlimit(resource.RLIMIT_FSIZE, (fsize, fsize))
        self.log.write(f"\n=== launch {self.relaunches} at step {self.resumed_at()} {env or ''} "
                       f"{'fsize ' + str(fsize) if fsize else ''}\n")
        self.log.flush()
        self.lines_before = set(metrics_lines(self.out))
        self.writes_before = self.writes_in_flight()
        return subprocess.Popen(self.command(self.out), stdout=self.log, stderr=subprocess.STDOUT, cwd=REPO,
                                env=dict(os.environ, **(env or {})), preexec_fn=limit, start_new_session=True)

    def resumed_at(self) -> int:
        done = [json.loads((c / "state.json").read_text())["step"] for c in checkpoints(self.out)
                if (c / "state.json").is_file()]
        return max(done, default=0)

    def wait_for_step(self, proc: subprocess.Popen, step: int, timeout: float = 300) -> bool:
        """Until the run has logged `step` (True), or the launch ended (False)."""
        deadline = time.monotonic() + timeout
        while proc.poll() is None and time.monotonic() < deadline:
            if step_reached(self.out, self.lines_before) >= step:
                return True
            time.sleep(0.05)
        return False

    def wait_for_write(self, proc: subprocess.Popen, point: str, timeout: float = 300) -> bool:
        """Until a checkpoint write of this launch has paused at `point`: its temporary folder
        holds the state file but no manifest ("manifest"), or the manifest, not yet renamed into
        place ("rename"). A folder an earlier launch left is not this launch's write."""
        deadline = time.monotonic() + timeout
        marker = "state.json" if point == "manifest" else "manifest.json"
        while proc.poll() is None and time.monotonic() < deadline:
            if any((p / marker).is_file() for p, _ in self.writes_in_flight() - self.writes_before):
                return True
            time.sleep(0.02)
        return False

    def writes_in_flight(self) -> set[tuple[Path, int]]:
        """The checkpoint writes' temporary folders, each as (path, inode): a folder of the same
        name made again is another write."""
        found = set()
        for p in (self.out / "checkpoints").glob(".tmp-step_*"):
            try:
                found.add((p, p.stat().st_ino))
            except FileNotFoundError:
                pass  # renamed into place or removed just now
        return found

    def finish(self, proc: subprocess.Popen, timeout: float = 300) -> int:
        try:
            return proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.findings.append(f"launch {self.relaunches} did not end within {timeout} s after its fault")
            os.killpg(proc.pid, signal.SIGKILL)
            return proc.wait()

    def kill_workers(self, which) -> bool:
        """SIGKILL "all" workers or "one", or send one of them the signal `which`; whether any got it."""
        workers = workers_of(self.out)
        hit = False
        for p in (workers if which == "all" else self.rng.sample(workers, 1) if workers else []):
            try:
                p.send_signal(signal.SIGKILL if which in ("all", "one") else which)
                hit = True
            except psutil.NoSuchProcess:
                pass
        return hit

    def rewrite_target(self) -> int | None:
        """Where a launch that rewrites a checkpoint can resume: the index in `checkpoints` of the
        one before the newest checkpoint at a step the run writes (a multiple of checkpoint.every;
        one written on a preemption is not)."""
        found = checkpoints(self.out)
        return next((i - 1 for i in range(len(found) - 1, 0, -1) if step_of(found[i]) % CHECKPOINT_EVERY == 0), None)

    def kill_in_rewrite(self, resume: int) -> tuple[subprocess.Popen, bool]:
        """A launch that resumes from checkpoint `resume` and rewrites the step of the next one,
        killed between the rewrite's renames; whether the kill landed there. The newer
        checkpoints are hidden until the launch has said where it resumes; then the one to be
        rewritten is put back and those after it are removed (the launch has dropped their step
        records from its run log, as a run that goes back to an earlier checkpoint does)."""
        found = checkpoints(self.out)
        rewritten, newer = found[resume + 1], found[resume + 1:]
        hidden = [c.with_name("hidden-" + c.name) for c in newer]  # not a checkpoint's name: not resumed from
        for c, h in zip(newer, hidden):
            c.rename(h)
        said_from = self.log.tell()
        try:
            proc = self.start({"HVDTRAIN_TEST_CHECKPOINT_PAUSE": "swap:2"})
            resumed = self.wait_for_output(proc, "resuming at step", said_from)
        finally:
            hidden[0].rename(rewritten)
            for h in hidden[1:]:
                shutil.rmtree(h)
        aside = rewritten.with_name(".old-" + rewritten.name)
        deadline = time.monotonic() + 300
        while resumed and proc.poll() is None and time.monotonic() < deadline and not aside.is_dir():
            time.sleep(0.02)
        return proc, resumed and aside.is_dir() and not rewritten.exists() and self.kill_workers("all")

    def wait_for_output(self, proc: subprocess.Popen, text: str, offset: int, timeout: float = 300) -> bool:
        """Until the launch has written `text` into the launch log after `offset` (True), or ended."""
        deadline = time.monotonic() + timeout
        while proc.poll() is None and time.monotonic() < deadline:
            self.log.flush()
            with open(self.log.name) as f:
                f.seek(offset)
                if text in f.read():
                    return True
            time.sleep(0.02)
        return False

    def damage_newest(self) -> bool:
        """Truncate or flip a byte of a weights file of the newest checkpoint, when an older one remains."""
        found = checkpoints(self.out)
        if len(found) < 2:
            return False
        victim = self.rng.choice(sorted(found[-1].glob("*.safetensors")))
        data = bytearray(victim.read_bytes())
        if self.rng.random() < 0.5:
            victim.write_bytes(data[:len(data) // 2])
        else:
            data[self.rng.randrange(len(data))] ^= 0xFF
            victim.write_bytes(data)
        return True

    def one_fault(self, kind: str):
        """One launch, ended by a fault of `kind` (damage: between this launch and the next)."""
        start = self.resumed_at()
        target = min(self.steps - 1, start + self.rng.randint(1, 6))
        env, fsize, point = None, None, self.rng.choice(["manifest", "rename"])
        if kind == "kill-in-write":
            env = {"HVDTRAIN_TEST_CHECKPOINT_PAUSE": f"{point}:2"}
        if kind == "write-failure":
            fsize = 2 << 20  # metrics.jsonl and the tokenizer fit; a checkpoint's optimizer state does not
        resume = self.rewrite_target() if kind == "kill-in-rewrite" else None
        if kind == "kill-in-rewrite" and resume is None:
            self.log.write(f"--- {kind}: no checkpoint to rewrite yet\n")
            return None
        if kind == "kill-in-rewrite":
            proc, landed = self.kill_in_rewrite(resume)  # starts its launch itself
        else:
            proc = self.start(env, fsize)
            landed = self.land(proc, kind, point, target)
        code = self.finish(proc)
        self.log.write(f"--- {kind}: exit {code}\n")
        reached = step_reached(self.out)
        self.leftover_workers(f"after launch {self.relaunches} ({kind})")
        self.relaunches += 1
        if not landed:
            self.log.write(f"--- {kind}: did not land (the launch ended first, exit {code})\n")
            return code
        self.injected[kind] += 1
        if kind == "preempt" and code != 75:
            self.findings.append(f"a preempted launch exited {code}, not 75")
        if code == 0:
            self.findings.append(f"a launch hit by {kind} exited 0")
        self.recomputed += max(0, reached - self.resumed_at())
        return code

    def land(self, proc: subprocess.Popen, kind: str, point: str, target: int) -> bool:
        """Inject a fault of `kind` into the launch `proc` (in a write pausing at `point`, or at
        step `target`); whether it landed before the launch ended."""
        if kind == "kill-in-write":
            return self.wait_for_write(proc, point) and self.kill_workers("all")
        if kind == "write-failure":
            return True  # the first checkpoint write fails
        if not self.wait_for_step(proc, target):
            return False
        if kind == "kill-launcher":
            os.kill(proc.pid, signal.SIGKILL)
            self.check_orphans()
            return True
        if kind == "preempt":
            return self.kill_workers(self.rng.choice([signal.SIGTERM, signal.SIGUSR1]))
        return self.kill_workers("one" if kind == "kill-worker" else "all")

    def check_orphans(self):
        """The launcher is gone: its workers must stop by themselves."""
        deadline = time.monotonic() + ORPHAN_GRACE_S
        while workers_of(self.out) and time.monotonic() < deadline:
            time.sleep(0.2)
        left = workers_of(self.out)
        if left:
            self.findings.append(f"{len(left)} worker(s) still running {ORPHAN_GRACE_S} s after their launcher "
                                 f"was killed")

    def leftover_workers(self, when: str):
        """No worker may outlive its launch; any found is a finding (and is ended)."""
        time.sleep(0.5)
        left = workers_of(self.out)
        if left:
            self.findings.append(f"{len(left)} worker(s) still running {when}")
            for p in left:
                p.kill()

    def run(self) -> int:
        """The faults in order, then launches until the run is complete; the last exit code."""
        plan = [self.rng.choice(self.kinds) for _ in range(self.faults)]
        if self.layout == "elastic":
            return self.run_elastic(len(plan))
        code, damaged = None, False
        for kind in plan:
            if step_reached(self.out) >= self.steps:
                break
            if kind == "damage":  # once between two launches: the next one must set it aside
                if not damaged and self.damage_newest():
                    self.injected["damage"] += 1
                    damaged = True
                continue
            code, damaged = self.one_fault(kind), False
        for _ in range(3):  # to the end, now without faults
            code = self.finish(self.start())
            self.relaunches += 1
            if code == 0:
                break
        return code

    def run_elastic(self, kills: int) -> int:
        """One elastic launch; a worker killed at random steps, each after the lost host came back."""
        proc = self.start({"HOROVOD_ELASTIC_TIMEOUT": "60"})
        for _ in range(kills):
            deadline = time.monotonic() + 120
            while proc.poll() is None and len(workers_of(self.out)) < 2 and time.monotonic() < deadline:
                time.sleep(0.1)  # both workers running again
            target = min(self.steps - 1, step_reached(self.out) + self.rng.randint(1, 4))
            if not self.wait_for_step(proc, target) or len(workers_of(self.out)) < 2:
                break
            self.kill_workers("one")
            self.injected["elastic-kill"] += 1
            self.log.write(f"--- elastic-kill {self.injected['elastic-kill']} at step {step_reached(self.out)}\n")
            self.log.flush()  # a campaign stopped early still shows how far it went
        code = self.finish(proc, timeout=600)
        self.relaunches = 0
        return code


def compare(campaign: Campaign, reference: Path, rtol: float) -> dict:
    """What the faulted run kept, against the uninterrupted one."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as transformers_logging
    transformers_logging.disable_progress_bar()
    out, steps = campaign.out, campaign.steps
    records = train_records(out)
    per_step = Counter(r["step"] for r in records)
    raw = metrics_lines(out)
    partial = [line for line in raw if line.strip() and not line.rstrip().endswith("}")]
    final = {r["step"]: r["loss"] for r in records}
    expected = {r["step"]: r["loss"] for r in train_records(reference)}
    lost = sorted(set(expected) - set(final))
    bitwise_losses = all(final.get(s) == v for s, v in expected.items())
    bad_losses = [s for s, v in expected.items() if s in final and abs(final[s] - v) > rtol * abs(v)]
    mine, theirs = load_file(str(out / "hf" / "model.safetensors")), load_file(str(reference / "hf" / "model.safetensors"))
    max_rel = max(((mine[k] - theirs[k]).abs().max() / theirs[k].abs().max().clamp_min(1e-12)).item() for k in theirs)
    bitwise_params = all((mine[k] == theirs[k]).all().item() for k in theirs)
    try:
        AutoModelForCausalLM.from_pretrained(out / "hf", use_safetensors=True, trust_remote_code=False)
        export_loads = True
    except Exception as error:  # noqa: BLE001 - any failure to load is the finding
        export_loads, campaign.findings = False, campaign.findings + [f"the export does not load: {error}"]
    root = out / "checkpoints"
    return {
        "steps": steps, "steps_lost": lost, "steps_with_loss_off": bad_losses,
        "duplicate_step_records": sum(n - 1 for n in per_step.values() if n > 1), "partial_lines": len(partial),
        "losses_bitwise": bitwise_losses, "params_bitwise": bitwise_params, "params_max_rel_diff": max_rel,
        "params_equal": bitwise_params or max_rel <= rtol,
        "temporary_folders_left": sorted(str(p.relative_to(out)) for p in out.rglob("*")
                                         if p.name.startswith((".tmp-", ".old-"))),
        "workers_left": len(workers_of(out)),
        "set_aside": len(list(root.glob("damaged-*"))) if root.is_dir() else 0,
        "export_loads": export_loads,
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layout", choices=sorted(KINDS), default="plain",
                        help="plain: 2 data-parallel workers; pipeline: 2 stages; elastic: --elastic, 1-2 workers")
    parser.add_argument("--faults", type=int, default=30)
    parser.add_argument("--kinds", type=lambda s: s.split(","), help="only these kinds of fault, comma-separated "
                        "(default: all of the layout's)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--steps", type=int, help="the run's length (default: 5 per fault + 12; elastic: 8 per fault "
                                                  "+ 12, as its kills come 1-4 steps after the lost host is back)")
    parser.add_argument("--rtol", type=float, default=1e-6, help="relative tolerance where not bitwise")
    parser.add_argument("--keep", help="keep the campaign's folders here (default: a temporary folder)")
    parser.add_argument("--json", action="store_true", help="print the result as one JSON line too")
    args = parser.parse_args()
    steps = args.steps or (8 if args.layout == "elastic" else 5) * args.faults + 12
    with tempfile.TemporaryDirectory(prefix="hvdtrain-faults-") as tmp:
        folder = Path(args.keep or tmp)
        folder.mkdir(parents=True, exist_ok=True)
        started = time.perf_counter()
        kinds = args.kinds or KINDS[args.layout]
        unknown = set(kinds) - set(KINDS[args.layout])
        if unknown:
            parser.error(f"--kinds: {', '.join(sorted(unknown))} is not a fault of layout {args.layout} "
                         f"(expected some of {', '.join(KINDS[args.layout])})")
        campaign = Campaign(folder, args.layout, kinds, args.faults, args.seed, steps)
        reference = folder / "reference"
        # The uninterrupted run: the same command (elastic: its fixed global batch on 2 workers).
        ref = subprocess.run(launch_command(folder, args.layout if args.layout != "elastic" else "plain",
                                            [*run_overrides(reference, steps, args.layout),
                                             f"data.cache_dir={campaign.cache}"]),
                             capture_output=True, text=True, cwd=REPO)
        if ref.returncode:
            raise SystemExit(f"the uninterrupted run failed ({ref.returncode}):\n{ref.stderr[-3000:]}")
        code = campaign.run()
        if code != 0:
            campaign.findings.append(f"the run did not complete: the last launch exited {code} "
                                     f"(see {folder / 'launches.log'} with --keep)")
            result = {"completed": False}
        else:
            result = {"completed": True, **compare(campaign, reference, args.rtol)}
        result.update(layout=args.layout, seed=args.seed, faults_injected=dict(campaign.injected),
                      relaunches=campaign.relaunches, steps_recomputed=campaign.recomputed,
                      findings=campaign.findings, wall_s=round(time.perf_counter() - started))
        report(result)
        if args.json:
            print(json.dumps(result))
    sys.exit(0 if result["completed"] and not campaign.findings and result["params_equal"]
             and not result["steps_lost"] and not result["steps_with_loss_off"] else 1)


def report(r: dict):
    print(f"fault campaign: layout {r['layout']}, seed {r['seed']}, {sum(r['faults_injected'].values())} faults, "
          f"{r['relaunches']} relaunches, {r['wall_s']} s")
    for kind, n in sorted(r["faults_injected"].items()):
        print(f"  {kind:<14} {n}")
    print(f"steps recomputed: {r['steps_recomputed']}")
    if r["completed"]:
        print(f"checkpoints set aside as damaged: {r['set_aside']}")
        print(f"lost: steps {r['steps_lost'] or 'none'}, losses off {r['steps_with_loss_off'] or 'none'}, "
              f"parameters {'equal' if r['params_equal'] else 'DIFFERENT'} "
              f"({'bitwise' if r['params_bitwise'] else 'max rel diff %.2e' % r['params_max_rel_diff']}), "
              f"losses {'bitwise' if r['losses_bitwise'] else 'within tolerance'}")
        print(f"duplicate step records: {r['duplicate_step_records']}, partial lines: {r['partial_lines']}, "
              f"temporary folders left: {r['temporary_folders_left'] or 'none'}, workers left: {r['workers_left']}, "
              f"export loads: {r['export_loads']}")
    for finding in r["findings"]:
        print(f"FINDING: {finding}")


if __name__ == "__main__":
    main()
