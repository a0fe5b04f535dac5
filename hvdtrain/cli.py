"""The `hvdtrain` command.

  hvdtrain train CONFIG [key=value ...]              one worker (under horovodrun, or alone)
  hvdtrain launch -np N [-H h1:4,h2:4] CONFIG [...]   N workers through horovodrun
  hvdtrain profile CONFIG [...]                      a short profiled run (see hvdtrain/profiling.py)
  hvdtrain doctor                                    what this installation can do
  hvdtrain export RUN_OR_CHECKPOINT OUT              a Hugging Face folder
  hvdtrain report RUN_DIR                            summary table and plots of a run
  hvdtrain bench overhead|scaling|allreduce          benchmarks
  hvdtrain plan CONFIG --gpus N                      memory, step time and scaling estimates
  hvdtrain generate MODEL "prompt" / fill-mask MODEL "text with [MASK]"

A user mistake (UserError) becomes one line on stderr and exit code 2, printed once (by
rank 0) even when many workers hit it.
"""
import argparse
import logging
import os
import shutil
import subprocess
import sys
import time

from hvdtrain import bench, export, inference, plan, report
from hvdtrain.errors import UserError

RANK_VARIABLES = ("HOROVOD_RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK", "SLURM_PROCID")


def process_rank() -> int:
    for var in RANK_VARIABLES:
        if var in os.environ:
            return int(os.environ[var])
    return 0


def run_train(args) -> int:
    from hvdtrain.config import load_config
    from hvdtrain.train import train

    train(load_config(args.config, args.overrides))
    return 0


def horovodrun_command(args, worker_args: list[str]) -> list[str]:
    horovodrun = shutil.which("horovodrun") or os.path.join(os.path.dirname(sys.executable), "horovodrun")
    if not os.path.exists(horovodrun):
        raise UserError("horovodrun was not found next to this Python; run `make setup` to install Horovod")
    cmd = [horovodrun, "-np", str(args.np)]
    if args.hosts:
        cmd += ["-H", args.hosts]
    if args.controller:
        cmd.append(f"--{args.controller}")
    if args.network_interface:
        cmd += ["--network-interface", args.network_interface]
    return cmd + args.horovodrun_args + [sys.executable, "-m", "hvdtrain.cli"] + worker_args


def relay_worker_stderr(stream) -> tuple[bool, str | None]:
    """Pass horovodrun's stderr through, except its own noise when a worker fails.

    Worker lines come prefixed with "[rank]<stderr>:". A worker's one-line user error is shown
    without the prefix; the "Terminated" notes of workers stopped because another one failed,
    and horovodrun's own Python traceback about that, are dropped. Returns (a worker reported
    a user error, horovodrun's failure summary or None)."""
    user_error, failure, in_traceback = False, None, False
    for line in stream:
        text = line.split(">:", 1)[1] if line.startswith("[") and ">:" in line else None
        if text is not None and text.startswith("hvdtrain: error: "):
            user_error = True
            sys.stderr.write(text)
        elif text is not None and text.strip() == "Terminated":
            continue
        elif text is None and line.startswith("Traceback (most recent call last):"):
            in_traceback = True
        elif in_traceback:
            if line.startswith(("RuntimeError:", "Process name:", "Exit code:")):
                failure = " ".join(filter(None, [failure, line.strip()]))
        else:
            sys.stderr.write(line)
        sys.stderr.flush()
    return user_error, failure


def run_launch(args) -> int:
    from hvdtrain.config import load_config

    load_config(args.config, args.overrides)  # fail here, once, before starting any worker
    if args.np < 1:
        raise UserError(f"-np: expected a number of workers >= 1, got {args.np}")
    cmd = horovodrun_command(args, ["train", args.config, *args.overrides])
    env = dict(os.environ)
    if not args.hosts and "OMP_NUM_THREADS" not in env:
        # One host: share its cores between the workers instead of oversubscribing them.
        env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // args.np))
    proc = subprocess.Popen(cmd, env=env, stderr=subprocess.PIPE, text=True, bufsize=1)
    user_error, failure = relay_worker_stderr(proc.stderr)
    code = proc.wait()
    if user_error:
        return 2
    if code and failure:
        print(f"hvdtrain: workers failed ({failure.split('The first process')[0].strip()} "
              f"{failure.split('terminated.')[-1].strip()})", file=sys.stderr)
    return code


def run_profile(args) -> int:
    args.overrides = ["profile.enabled=true", *args.overrides]
    return run_launch(args) if args.np > 1 else run_train(args)


def run_doctor(args) -> int:
    from hvdtrain.doctor import run_doctor as doctor
    return doctor(args)


def add_launch_options(p: argparse.ArgumentParser, default_np: int):
    p.add_argument("-np", "--num-proc", dest="np", type=int, default=default_np, help="number of workers")
    p.add_argument("-H", "--hosts", help="host1:slots,host2:slots (default: this host)")
    group = p.add_mutually_exclusive_group()
    group.add_argument("--gloo", dest="controller", action="store_const", const="gloo", help="Gloo controller")
    group.add_argument("--mpi", dest="controller", action="store_const", const="mpi", help="MPI controller")
    p.add_argument("--network-interface", help="interface(s) for Horovod traffic, e.g. eth0 (NCCL: set NCCL_SOCKET_IFNAME)")
    p.add_argument("--horovodrun-args", dest="horovodrun_args", default=[], type=str.split,
                   help="extra horovodrun options, quoted as one string")


def add_config_args(p: argparse.ArgumentParser):
    p.add_argument("config", help="YAML recipe, e.g. recipes/gpt-tiny.yaml")
    p.add_argument("overrides", nargs="*", help="dotted overrides such as train.lr=3e-4")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hvdtrain", description="Horovod data-parallel pretraining of BERT and GPT.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("train", help="run one worker (start it with horovodrun, or alone)")
    add_config_args(p)
    p.set_defaults(func=run_train)

    p = sub.add_parser("launch", help="start N workers with horovodrun")
    add_launch_options(p, default_np=2)
    add_config_args(p)
    p.set_defaults(func=run_launch)

    p = sub.add_parser("profile", help="a profiled run: torch.profiler traces and the Horovod timeline")
    add_launch_options(p, default_np=1)
    add_config_args(p)
    p.set_defaults(func=run_profile)

    p = sub.add_parser("doctor", help="show what this installation can do")
    p.set_defaults(func=run_doctor)

    # Subcommands defined next to their code; those modules import torch lazily, so
    # `hvdtrain --help` stays fast.
    for module in (export, inference, plan, report, bench):
        module.add_cli(sub)
    return parser


def main(argv=None) -> int:
    parser = build_parser()
    # Overrides may also come after options (`hvdtrain plan cfg.yaml --gpus 8 train.lr=1`).
    args, extra = parser.parse_known_args(argv)
    if extra and hasattr(args, "overrides") and all("=" in e and not e.startswith("-") for e in extra):
        args.overrides += extra
    elif extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    # hvdtrain's modules log progress notes (e.g. data cache hits) at INFO: shown by rank 0 only.
    logging.basicConfig(format="hvdtrain: %(message)s", stream=sys.stdout)
    logging.getLogger("hvdtrain").setLevel(logging.INFO if process_rank() == 0 else logging.WARNING)
    try:
        return args.func(args)
    except UserError as e:
        if process_rank() == 0:
            print(f"hvdtrain: error: {e}", file=sys.stderr, flush=True)
        else:
            time.sleep(2)  # the same error on every rank: let rank 0 report it before we exit
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
