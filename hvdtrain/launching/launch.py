"""Starting workers: `hvdtrain launch` runs N copies of `hvdtrain train` through horovodrun.

Used by the CLI (`launch`, `profile`) and by the benchmarks that start workers (`bench
allreduce`). Remote hosts are checked over ssh first; horovodrun's output then goes through
hvdtrain.launching.relay, so that the user sees each real error once.
"""
import argparse
import os
import shutil
import signal
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

from hvdtrain.errors import UserError
from hvdtrain.launching.relay import Relay
from hvdtrain.observe.progress import LAUNCHED
from hvdtrain.observe.trackers import check_installed


# What horovodrun runs on each slot, before the worker's arguments
WORKER_COMMAND = [sys.executable, "-m", "hvdtrain.cli"]


def horovodrun_command(args, worker_args: list[str]) -> list[str]:
    horovodrun = shutil.which("horovodrun") or os.path.join(os.path.dirname(sys.executable), "horovodrun")
    if not os.path.exists(horovodrun):
        raise UserError("horovodrun was not found next to this Python; run `make setup` to install Horovod")
    elastic = elastic_options(args) if getattr(args, "elastic", False) else []
    interface = args.network_interface or (elastic_interface(args) if elastic else None)
    cmd = [horovodrun, "-np", str(args.np)]
    if args.hosts:
        cmd += ["-H", args.hosts]
    if args.controller:
        cmd.append(f"--{args.controller}")
    if interface:
        cmd += ["--network-interface", interface]
    if args.start_timeout is not None:
        cmd += ["--start-timeout", str(args.start_timeout)]
    return cmd + elastic + args.horovodrun_args + WORKER_COMMAND + worker_args


def elastic_options(args) -> list[str]:
    """horovodrun's elastic flags (Gloo only): the worker range, where hosts come from, and how
    failures are handled."""
    if args.controller == "mpi":
        raise UserError("--elastic runs on Gloo (Horovod Elastic has no MPI mode); drop --mpi")
    if not args.host_discovery_script and not args.hosts:
        raise UserError("--elastic needs --host-discovery-script FILE (prints host:slots lines) or -H hosts")
    min_np, max_np = args.min_np or args.np, args.max_np or args.np
    if not 1 <= min_np <= args.np <= max_np:
        raise UserError(f"--elastic: expected 1 <= --min-np ({min_np}) <= -np ({args.np}) <= --max-np ({max_np})")
    cmd = ["--min-np", str(min_np), "--max-np", str(max_np)]
    if args.host_discovery_script:
        if not os.access(args.host_discovery_script, os.X_OK):
            raise UserError(f"--host-discovery-script '{args.host_discovery_script}' is not an executable file")
        cmd += ["--host-discovery-script", args.host_discovery_script]
    if args.reset_limit is not None:
        cmd += ["--reset-limit", str(args.reset_limit)]
    if args.blacklist_cooldown_range:
        cmd += ["--blacklist-cooldown-range", *map(str, args.blacklist_cooldown_range)]
    if args.elastic_timeout is not None:
        cmd += ["--elastic-timeout", str(args.elastic_timeout)]
    return cmd


def elastic_interface(args) -> str | None:
    """The --network-interface of an elastic job that names none, or None to let Horovod find it.

    Horovod Elastic finds the interface its hosts share by testing between two of them, so a
    job that starts on one host would wait, silently, until --elastic-timeout (600 s) for a
    second. When every host the job starts with (-H, or what the discovery script prints now)
    is this machine, its workers talk over the loopback interface; one other machine alone is
    refused: only the user knows the interface it is reached on."""
    names = sorted(set(host_slots(args.hosts) if args.hosts else discovered_hosts(args)))
    if not names:
        return None  # no host yet: Horovod waits for one, up to --elastic-timeout, and then says so
    from horovod.runner.util.network import filter_local_addresses, get_local_intfs

    loopback = sorted(get_local_intfs())  # the interfaces of 127.0.0.1: Horovod's own choice for local hosts
    if not filter_local_addresses(names) and loopback:
        return loopback[0]
    if len(names) == 1:
        raise UserError(f"--elastic on one host ({names[0]}) needs --network-interface (e.g. eth0, the interface "
                        "that host is reached on): Horovod Elastic finds it by testing between two hosts")
    return None


def discovered_hosts(args) -> list[str]:
    """The host names --host-discovery-script prints now (host:slots lines), [] when it fails
    or gives no answer within the start timeout (Horovod then runs it again)."""
    try:
        proc = subprocess.run([os.path.abspath(args.host_discovery_script)], capture_output=True, text=True,
                              stdin=subprocess.DEVNULL, timeout=start_timeout(args))
    except subprocess.TimeoutExpired:
        return []
    lines = proc.stdout.split() if proc.returncode == 0 else []
    return [line.partition(":")[0] for line in lines]


def host_slots(hosts: str) -> list[str]:
    """The host of each slot of `-H a:2,b:2`, in order."""
    slots = []
    for entry in hosts.split(","):
        name, _, count = entry.partition(":")
        if not name or not (count or "1").isdigit():
            raise UserError(f"-H: expected host1:slots,host2:slots (e.g. node1:8,node2:8), got '{hosts}'")
        slots += [name] * int(count or 1)
    return slots


def hosts_by_rank(hosts: str | None, np: int) -> list[str]:
    """The host of each rank: horovodrun and mpirun fill the slots of `-H a:2,b:2` in order."""
    return host_slots(hosts)[:np] if hosts else []


def start_timeout(args) -> int:
    """Seconds horovodrun waits for the hosts and workers to start (its default: 30)."""
    if args.start_timeout is not None:
        return args.start_timeout
    return int(os.environ.get("HOROVOD_START_TIMEOUT", 30))


def check_hosts_reachable(args):
    """ssh into every remote host of -H once, in parallel, with the ssh command horovodrun uses
    (its -p/--ssh-port and -i/--ssh-identity-file from --horovodrun-args), bounded by the start
    timeout. horovodrun's own check tries 5 times with a fixed 10 s timeout and names the host
    only on stdout."""
    from horovod.runner.util.network import filter_local_addresses
    from horovod.runner.util.remote import get_remote_command

    ssh = argparse.ArgumentParser(add_help=False)
    ssh.add_argument("-p", "--ssh-port", type=int)
    ssh.add_argument("-i", "--ssh-identity-file")
    ssh_args, _ = ssh.parse_known_args(args.horovodrun_args)
    remote = filter_local_addresses(sorted(set(hosts_by_rank(args.hosts, args.np))))
    timeout = start_timeout(args)

    def problem(host: str) -> str | None:
        cmd = get_remote_command("true", host, ssh_args.ssh_port, ssh_args.ssh_identity_file, timeout)
        try:
            proc = subprocess.run(cmd, shell=True, capture_output=True, text=True, stdin=subprocess.DEVNULL,
                                  timeout=timeout + 5)
        except subprocess.TimeoutExpired:
            said = ["no answer"]
        else:
            if proc.returncode == 0:
                return None
            said = [line for line in proc.stderr.splitlines() if line.strip() and not line.startswith("Warning:")]
        return f"cannot reach host {host} over ssh (--start-timeout {timeout} s): {(said or ['?'])[-1]}"

    with ThreadPoolExecutor(max(1, len(remote))) as pool:
        problems = [p for p in pool.map(problem, remote) if p]
    if problems:
        raise UserError("; ".join(problems))


def join_output_streams():
    """In a worker of `hvdtrain launch` (LAUNCHED set): stderr goes into stdout's pipe, unbuffered, so that what
    the worker says reaches the user in the order it happened. horovodrun and mpirun read a
    worker's stdout and stderr through two pipes and pass on whichever has output first (a
    warning printed before an evaluation could come after it); the relay tells errors apart
    by what they say, not by their stream."""
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(sys.stdout.fileno(), sys.stderr.fileno())


def run_launch(args) -> int:
    from hvdtrain.config import load_config

    cfg = load_config(args.config, args.overrides)  # fail here, once, before starting any worker
    check_installed(cfg)
    if args.np < 1:
        raise UserError(f"-np: expected a number of workers >= 1, got {args.np}")
    cmd = horovodrun_command(args, ["train", args.config, *args.overrides])
    if args.hosts:
        if len(hosts_by_rank(args.hosts, args.np)) < args.np:
            raise UserError(f"-np {args.np} is more than the slots of -H {args.hosts}")
        check_hosts_reachable(args)
    env = dict(os.environ, PYTHONUNBUFFERED="1", **{LAUNCHED: "1"})
    if not args.hosts:
        # One host: its workers share its cores. Give each its share of compute threads, and
        # make Open MPI (under --mpi) yield the core while a worker waits instead of spinning.
        env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // args.np)))
        env.setdefault("OMPI_MCA_mpi_yield_when_idle", "1")
    relay = Relay(hosts_by_rank(args.hosts, args.np), args.np)
    # horovodrun in a process group of its own, watched by a guard that stops it if this launcher
    # dies (hvdtrain.launching.launcher_guard). A stop signal for the job (a scheduler's SIGTERM, Ctrl-C's
    # SIGINT) stops the workers as on a preemption (see pass_on), and the launcher goes on showing
    # what they say until they have stopped.
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1,
                            start_new_session=True)
    # The guard in a session of its own too: a SIGKILL to the launcher's whole process group (a
    # shell's `kill -9 %1`) must not take the guard with it.
    guard = subprocess.Popen([sys.executable, "-m", "hvdtrain.launching.launcher_guard", str(proc.pid), str(os.getpid())],
                             start_new_session=True)

    stop_signals = []

    def pass_on(signum, frame):
        """The first stop signal goes to this host's workers as SIGTERM: they agree on a step with
        the others, write its checkpoint and exit, and horovodrun ends with them. horovodrun's own
        stop would kill them 5 seconds later (Horovod's GRACEFUL_TERMINATION_TIME_S; mpirun at
        once), too soon for a large model's checkpoint. A second signal, no worker here (all on
        other hosts) or an elastic job (left to Horovod's elastic driver, as before) still takes
        that way."""
        stop_signals.append(signum)
        if len(stop_signals) == 1 and not getattr(args, "elastic", False) and signal_workers(proc.pid, signal.SIGTERM):
            return
        try:
            os.killpg(proc.pid, signum)
        except ProcessLookupError:
            pass  # the job has ended already

    handlers = {signum: signal.signal(signum, pass_on) for signum in (signal.SIGINT, signal.SIGTERM)}
    try:
        for line in proc.stdout:
            relay.feed(line)
        return relay.finish(proc.wait())
    finally:
        for signum, handler in handlers.items():
            signal.signal(signum, handler)
        guard.kill()
        guard.wait()


def signal_workers(horovodrun: int, signum: int) -> bool:
    """Send `signum` to the workers of this host under process `horovodrun` (behind Horovod's
    shells, or mpirun), not to their DataLoader processes: forks with a worker's command line,
    which stop with it (torch's DataLoader takes a signal to one for its failure). False when
    none is here, or none whose command line can be read."""
    import psutil

    def is_worker(process) -> bool:
        try:
            return process.cmdline()[1:3] == WORKER_COMMAND[1:]
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            return False  # ended meanwhile, or hidden from this user
    try:
        workers = [process for process in psutil.Process(horovodrun).children(recursive=True) if is_worker(process)]
    except psutil.NoSuchProcess:
        return False
    pids, sent = {process.pid for process in workers}, False
    for process in workers:
        try:
            if process.ppid() not in pids:
                process.send_signal(signum)
                sent = True
        except psutil.NoSuchProcess:
            pass  # ended meanwhile
    return sent


def add_launch_options(p: argparse.ArgumentParser, default_np: int):
    p.add_argument("-np", "--num-proc", dest="np", type=int, default=default_np, help="number of workers")
    p.add_argument("-H", "--hosts", help="host1:slots,host2:slots (default: this host)")
    group = p.add_mutually_exclusive_group()
    group.add_argument("--gloo", dest="controller", action="store_const", const="gloo", help="Gloo controller")
    group.add_argument("--mpi", dest="controller", action="store_const", const="mpi", help="MPI controller")
    p.add_argument("--network-interface", help="interface(s) for Horovod traffic, e.g. eth0 (NCCL: set NCCL_SOCKET_IFNAME; "
                        "default: Horovod tests between the hosts; an elastic job on this machine alone: lo)")
    p.add_argument("--start-timeout", type=int, metavar="SECONDS",
                   help="how long to wait for each host (ssh) and for the workers to start (default 30, "
                        "or HOROVOD_START_TIMEOUT)")
    p.add_argument("--horovodrun-args", dest="horovodrun_args", default=[], type=str.split,
                   help="extra horovodrun options, quoted as one string")


def add_elastic_options(p: argparse.ArgumentParser):
    g = p.add_argument_group("elastic jobs (Horovod Elastic): workers may be lost or added while the run goes on")
    g.add_argument("--elastic", action="store_true", help="run as an elastic job (needs train.global_batch_size)")
    g.add_argument("--min-np", type=int, help="fewest workers to go on with (default -np)")
    g.add_argument("--max-np", type=int, help="most workers to grow to (default -np)")
    g.add_argument("--host-discovery-script", help="executable that prints the available host:slots, one a line")
    g.add_argument("--reset-limit", type=int, help="most resets before the job gives up")
    g.add_argument("--blacklist-cooldown-range", type=int, nargs=2, metavar=("MIN_S", "MAX_S"),
                   help="a failed host may come back after a cooldown between these seconds (default: never)")
    g.add_argument("--elastic-timeout", type=int, metavar="SECONDS",
                   help="how long to wait for --min-np workers before failing (default 600)")


def add_config_args(p: argparse.ArgumentParser):
    p.add_argument("config", help="YAML recipe, e.g. recipes/gpt-tiny.yaml")
    p.add_argument("overrides", nargs="*", help="dotted overrides such as train.lr=3e-4")
