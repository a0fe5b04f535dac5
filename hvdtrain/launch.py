"""Starting workers: `hvdtrain launch` runs N copies of `hvdtrain train` through horovodrun.

Used by the CLI (`launch`, `profile`) and by the benchmarks that start workers (`bench
allreduce`). Workers' stderr is relayed so that the user sees each real error once.
"""
import argparse
import os
import shutil
import subprocess
import sys

from hvdtrain.errors import UserError


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
