"""The `hvdtrain` command.

  hvdtrain train CONFIG [key=value ...]              one worker (under horovodrun, or alone)
  hvdtrain launch -np N [-H h1:4,h2:4] CONFIG [...]   N workers through horovodrun (--elastic: Horovod Elastic)
  hvdtrain prepare CONFIG [...]                      tokenize the data into the cache (alone or under horovodrun)
  hvdtrain profile CONFIG [...]                      a short profiled run (see hvdtrain/observe/profiling.py)
  hvdtrain doctor                                    what this installation can do
  hvdtrain export RUN_OR_CHECKPOINT OUT              a Hugging Face folder
  hvdtrain report RUN_DIR                            summary table and plots of a run
  hvdtrain bench compare|overhead|scaling|allreduce|pipeline   benchmarks
  hvdtrain plan CONFIG --gpus N                      memory, step time and scaling estimates
  hvdtrain tune CONFIG --gpus N [--budget MINUTES]   run the layouts that fit; the fastest as a recipe
  hvdtrain generate MODEL "prompt" / fill-mask MODEL "text with [MASK]"

A user mistake (UserError) becomes one line on stderr and exit code 2. Every worker that hits
one prints it, as only that worker may know it (a data path missing on one host); `hvdtrain
launch` shows the first one once, plain horovodrun and mpirun show one line per worker.
"""
import argparse
import logging
import os
import sys

from hvdtrain.tools import bench, inference, plan, report, tune
from hvdtrain.checkpointing import export
from hvdtrain.data import prepare_job as prepare
from hvdtrain.errors import UserError
from hvdtrain.launching.launch import (add_config_args, add_elastic_options, add_launch_options, join_output_streams,
                                       run_launch)
from hvdtrain.observe.progress import LAUNCHED

RANK_VARIABLES = ("HOROVOD_RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK", "SLURM_PROCID")


def process_rank() -> int:
    for var in RANK_VARIABLES:
        if var in os.environ:
            return int(os.environ[var])
    return 0


def run_train(args) -> int:
    from hvdtrain.config import load_config

    # The config first: it needs no torch, so a mistake in it is told in a fraction of a second.
    cfg = load_config(args.config, args.overrides)
    from hvdtrain.training.stopping import PreemptionSignal, RunStopped

    preemption = PreemptionSignal()  # a stop during the set-up stops the run at its first step
    try:
        from hvdtrain.parallel.distributed import is_elastic_job  # imports torch and Horovod (seconds)

        if is_elastic_job():
            from hvdtrain.parallel.elastic import train_elastic as train
        else:
            from hvdtrain.training.train import train
        train(cfg)
    except RunStopped as stopped:  # on purpose (preemption, divergence): its own exit code
        if process_rank() == 0:
            print(f"hvdtrain: stopped: {stopped}", file=sys.stderr, flush=True)
        return stopped.exit_code
    finally:
        preemption.close()
    return 0


def run_profile(args) -> int:
    args.overrides = ["profile.enabled=true", *args.overrides]
    return run_launch(args) if args.np > 1 else run_train(args)


def run_doctor(args) -> int:
    from hvdtrain.tools.doctor import run_doctor as doctor
    return doctor(args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hvdtrain", description="Horovod data-parallel pretraining of BERT and GPT.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("train", help="run one worker (start it with horovodrun, or alone)")
    add_config_args(p)
    p.set_defaults(func=run_train)

    p = sub.add_parser("launch", help="start N workers with horovodrun")
    add_launch_options(p, default_np=2)
    add_elastic_options(p)
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
    for module in (prepare, export, inference, plan, report, bench, tune):
        module.add_cli(sub)
    return parser


def main(argv=None) -> int:
    if LAUNCHED in os.environ:  # a worker of `hvdtrain launch`
        join_output_streams()
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
        print(f"hvdtrain: error: {e}", file=sys.stderr, flush=True)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
