"""What the user sees of a horovodrun job: rank 0's output as it comes, and each real error once.

horovodrun prefixes every line a worker writes with its rank: `[R]<stderr>:` under Gloo,
`[1,R]<stderr>:` under MPI (mpirun --tag-output). While the job runs, `Relay.feed` shows rank 0's
lines without that tag, as `accelerate launch` or `torchrun` would: its progress lines
(hvdtrain.observe.progress) as one bar redrawn in place when the launcher's output is a
terminal, as plain lines otherwise. The other ranks' lines are shown only when they matter (a
warning, an error), tagged with their worker then. Workers of `hvdtrain launch` write stderr into
stdout (hvdtrain.launching.launch.join_output_streams): what a line is comes from what it says.

When one worker fails, the others fail after it (tracebacks saying "Horovod has been shut down",
"Terminated"), and horovodrun or mpirun add their own report. `Relay.feed` holds back what may be
an error; when the job has ended, `Relay.finish` shows the first real one:

1. the first one-line user error of any worker (`hvdtrain: error: ...`, exit code 2): every
   worker that hits one prints it, so the same mistake on all ranks is shown once; or the
   stalled workers, from what the stall watchdogs said (hvdtrain.training.run_guards.StallWatchdog):
   those that said they were stuck, else those that said nothing while the others waited;
2. else the first traceback that is not an echo of another worker's failure, with its rank;
3. else what horovodrun or mpirun report: the worker that exited first without saying why
   (killed by a signal, its program missing on its host), or horovodrun's own error when it
   could not start the workers.
"""
import re
import signal
import sys
from dataclasses import dataclass, field

from hvdtrain.observe.progress import SUMMARY, ProgressDisplay, parse_progress_line

WORKER_PREFIX = re.compile(r"\[(?:\d+,)?(\d+)\]<(stdout|stderr)>:")
USER_ERROR = "hvdtrain: error: "
STALLED = "hvdtrain: stalled: "  # the stall watchdog's line, on every worker that is not stopped
# An elastic job's stalled worker leaves it and the others go on: its line is passed through as
# it comes (hvdtrain.training.run_guards.StallWatchdog, hvdtrain.training.stop_sentinel).
LEAVING = "hvdtrain: stalled, leaving the elastic job: "
ONE_LINERS = (USER_ERROR, "hvdtrain: stopped: ", STALLED)  # cli.main's user error; a run stopped on purpose
STALL_LINE = re.compile(re.escape(STALLED) + r"rank \d+ is (waiting for the others|stuck): ([^;]*); (.*)")
TRACEBACK = "Traceback (most recent call last):"
# What a worker reports when it stops because another worker failed first.
ECHOES = ("Horovod has been shut down", "Horovod background loop uncaught exception",
          # torch.distributed's Gloo (the pipeline's sends and receives) when the peer has exited
          "This is typically caused by a remote worker crashing")
# Open MPI's shared-memory transport when the worker it was reading from has exited (ESRCH).
MPI_PEER_GONE = re.compile(r"Read -1, expected \d+, errno = 3$")


def is_echo(line: str) -> bool:
    return any(echo in line for echo in ECHOES) or bool(MPI_PEER_GONE.search(line.rstrip()))

# A line of a rank other than 0 that the user sees as it comes (and LEAVING's).
WORTH_SHOWING = re.compile(r"warn|error|exception|fatal", re.IGNORECASE)

# What the shell running a worker says when the worker is stopped by a signal: the report of
# the first failed worker says it better, and for the others it is only an echo.
SHELL_NOTES = ("Terminated", "Killed")

# horovodrun's and mpirun's own reports (lines without a rank prefix).
PROCESS_EXIT = re.compile(r"Process (\d+) exit with status code (-?\d+)\.")  # Gloo, one per worker
FIRST_FAILED_RANK = re.compile(r"Process name:\s*(?:\[\[\d+,\d+\],)?(\d+)\]?")  # Gloo and mpirun
FIRST_EXIT_CODE = re.compile(r"Exit code:\s*(-?\d+)")
MPI_SIGNAL = re.compile(r"process rank (\d+) with PID \d+ on node \S+ exited on signal (\d+)")
SSH_FAILED = re.compile(r"^ssh not successful for host (\S+):\n\s*(.*)$", re.M)
WORKERS_FAILED = "Horovod detected that one or more processes exited with non-zero status"
# Elastic jobs name a worker by host and slot, and stop when too few are left for too long.
ELASTIC_FAILED = re.compile(r"Process name:\s*(\S+)\[(\d+)\]\s*\nExit code:\s*(-?\d+)")
ELASTIC_TIMEOUT = re.compile(r"enough resources to run at least (\d+) Horovod processes\. Timeout after (\d+) seconds")
MPI_ECHO_BOXES = ("Primary job  terminated normally", "mpirun detected that one or more processes exited",
                  "mpirun noticed that process rank")


@dataclass
class Message:
    """What a worker said about why it stops, in arrival order: a one-line user error or
    `hvdtrain: stopped: ...` note, or a traceback (to the end of the worker's output)."""
    rank: int
    lines: list[str] = field(default_factory=list)

    @property
    def is_one_line(self) -> bool:
        return self.lines[0].startswith(ONE_LINERS)

    @property
    def is_echo(self) -> bool:
        return any(is_echo(line) for line in self.lines)


class Relay:
    """`terminal`: draw rank 0's progress as a bar on `out` (default: when `out` is a terminal)."""

    def __init__(self, hosts_by_rank: list[str], world_size: int, out=None, err=None, terminal: bool | None = None):
        self.hosts_by_rank = hosts_by_rank  # empty when all workers run here
        self.world_size = world_size
        self.out, self.err = out or sys.stdout, err or sys.stderr
        self.display = ProgressDisplay(self.out, terminal)
        self.messages: list[Message] = []
        self.open_traceback: dict[int, Message] = {}
        self.partial: dict[tuple[int, str], str] = {}  # (rank, channel): the text of its line so far
        self.last_line: dict[int, str] = {}  # each worker's last line that was not held back
        self.launcher_lines: list[str] = []  # horovodrun's and mpirun's own output, held to the end

    def feed(self, line: str):
        """One line of horovodrun's output. mpirun tags each piece a worker writes, so one line
        may hold several tagged pieces: they are joined per worker up to its newline."""
        tags = list(WORKER_PREFIX.finditer(line))
        if not tags or tags[0].start() != 0:
            self.launcher_lines.append(line)
            return
        for tag, end in zip(tags, [t.start() for t in tags[1:]] + [len(line)]):
            key = (int(tag[1]), tag[2])
            text = self.partial.pop(key, "") + line[tag.end():end]
            if text.endswith("\n"):
                self.worker_line(key[0], text)
            else:
                self.partial[key] = text

    def worker_line(self, rank: int, text: str):
        if rank in self.open_traceback:  # a worker's traceback is the last thing it prints
            self.open_traceback[rank].lines.append(text)
        elif text.startswith(TRACEBACK):
            self.open_traceback[rank] = Message(rank, [text])
            self.messages.append(self.open_traceback[rank])
        elif text.startswith(ONE_LINERS) or is_echo(text):
            self.messages.append(Message(rank, [text]))
        elif text.strip() not in SHELL_NOTES:
            self.last_line[rank] = text.strip()
            self.show(rank, text)

    def show(self, rank: int, text: str):
        """A line as the user sees it: rank 0's as it is (its progress drawn as the bar), another
        rank's tagged with its worker, and only when it matters."""
        progress = parse_progress_line(text) if rank == 0 else None
        if progress is not None:
            self.display.update(progress)
        elif rank == 0:
            if text.startswith(SUMMARY):
                self.display.close()
            self.display.message(text)
        elif WORTH_SHOWING.search(text) or text.startswith(LEAVING):
            self.display.message(f"[{self.worker(rank)}] {text}")

    def finish(self, returncode: int) -> int:
        """Show what was held back; return the exit code for `hvdtrain launch`: 2 for a user
        error, else that of the first worker that failed (or horovodrun's)."""
        for (rank, _), text in list(self.partial.items()):  # output cut short
            self.worker_line(rank, text + "\n")
        if returncode == 0:  # nothing failed: what was held back was no error; show it
            for message in self.messages:
                for line in message.lines:
                    self.display.message(line if message.rank == 0 else f"[{self.worker(message.rank)}] {line}")
            self.display.close()
            self.out.writelines(self.launcher_lines)
            return 0
        self.display.close()  # the bar stays as it was; the error comes below it
        causes = [m for m in self.messages if not m.is_echo]
        failed = self.first_failed_worker()
        stalls = [m for m in causes if STALL_LINE.match(m.lines[0])]
        if stalls and not any(m.lines[0].startswith(USER_ERROR) for m in causes):
            self.err.write(self.stalled_workers(stalls))
            return failed[1] if failed and failed[1] > 0 else returncode
        if causes and causes[0].is_one_line:
            line, rank = causes[0].lines[0], causes[0].rank
            # With several hosts, say where: the data may be missing on one host only.
            self.err.write(f"{line.rstrip()} ({self.worker(rank)})\n" if self.hosts_by_rank else line)
            return 2 if line.startswith(USER_ERROR) else failed[1] if failed else returncode
        launcher = "".join(self.launcher_lines)
        elastic_failed, too_few = ELASTIC_FAILED.search(launcher), ELASTIC_TIMEOUT.search(launcher)
        if causes:
            self.err.write(f"hvdtrain: {self.worker(causes[0].rank)} failed:\n")
            self.err.writelines(causes[0].lines)
        elif elastic_failed:
            host, slot, code = elastic_failed.groups()
            self.err.write(self.worker_exit(int(slot), int(code)).replace(f"worker {slot}", f"the worker on host {host}"))
        elif failed:
            self.err.write(self.worker_exit(*failed))
        else:
            self.err.write(self.launcher_error(returncode))
        if too_few:
            self.err.write(f"hvdtrain: error: the elastic job had fewer than --min-np {too_few[1]} workers for longer "
                           f"than --elastic-timeout ({too_few[2]} s) and stopped; the same command resumes from its "
                           f"last checkpoint\n")
        return failed[1] if failed and failed[1] > 0 else returncode

    def stalled_workers(self, stalls: list[Message]) -> str:
        """One line naming the stalled workers: those whose watchdog said they were stuck (and
        where), else those that said nothing while every other one waited for them (stopped,
        or their host hung)."""
        said = {m.rank: STALL_LINE.match(m.lines[0]).groups() for m in stalls}
        stuck = [f"{self.worker(rank)} stalled: {since}; {where}" for rank, (kind, since, where) in said.items()
                 if kind == "stuck"]
        if stuck:
            return "hvdtrain: error: " + "; ".join(stuck) + "\n"
        since = next(iter(said.values()))[1]
        silent = [self.worker(rank) for rank in range(self.world_size) if rank not in said]
        if not silent:
            return (f"hvdtrain: error: every worker waited for the others ({since}): a collective operation "
                    f"that not all of them started\n")
        return (f"hvdtrain: error: {', '.join(silent)} stalled: the other workers waited for it in a collective "
                f"operation, {since}; it was stopped, or its host hung or lost its network\n")

    def first_failed_worker(self) -> tuple[int, int] | None:
        """(rank, exit code; -N for signal N) of the first worker that failed, as horovodrun or
        mpirun report it."""
        text = "".join(self.launcher_lines)
        killed = MPI_SIGNAL.search(text)
        if killed:
            return int(killed[1]), -int(killed[2])
        exits = [(int(rank), int(code)) for rank, code in PROCESS_EXIT.findall(text) if int(code) != 0]
        if exits:
            return exits[0]
        rank, code = FIRST_FAILED_RANK.search(text), FIRST_EXIT_CODE.search(text)
        return (int(rank[1]), int(code[1])) if rank and code else None

    def launcher_error(self, returncode: int) -> str:
        """No worker ran or failed: horovodrun's or mpirun's own error, as few lines."""
        unreachable = SSH_FAILED.findall("".join(self.launcher_lines))
        if unreachable:
            return "".join(f"hvdtrain: error: cannot reach host {host} over ssh: {why}\n" for host, why in unreachable)
        return (horovodrun_error(self.launcher_lines) or mpirun_boxes(self.launcher_lines) or
                "".join(self.launcher_lines) + f"hvdtrain: error: horovodrun exited with status {returncode}\n")

    def worker(self, rank: int) -> str:
        host = self.hosts_by_rank[rank] if rank < len(self.hosts_by_rank) else None
        return f"worker {rank}" + (f" on host {host}" if host else "")

    def worker_exit(self, rank: int, code: int) -> str:
        # A shell reports a child killed by signal N as status 128 + N; Python's subprocess as -N.
        signum = -code if code < 0 else code - 128 if 128 < code < 160 else None
        if signum:
            name = signal.Signals(signum).name if signum in set(signal.Signals) else "?"
            oom = ", out of memory?" if signum == signal.SIGKILL else ""
            return f"hvdtrain: error: {self.worker(rank)} was killed by signal {signum} ({name}{oom})\n"
        why = self.last_line.get(rank)  # e.g. the shell's "python: No such file or directory"
        return f"hvdtrain: error: {self.worker(rank)} exited with status {code}" + (f": {why}" if why else "") + "\n"


def horovodrun_error(lines: list[str]) -> str | None:
    """horovodrun's own error: its usage error, or the exception that ends its traceback (up to
    the first blank line; the rest is advice for pip users)."""
    for line in lines:
        if line.startswith("horovodrun: error: "):
            return f"hvdtrain: error: {line}"
    starts = [i for i, line in enumerate(lines) if line.startswith(TRACEBACK)]
    if not starts:
        return None
    after = lines[starts[-1] + 1:]
    first = next((i for i, line in enumerate(after) if line.strip() and not line.startswith(" ")), None)
    if first is None or WORKERS_FAILED in after[first]:
        return None
    message = [after[first].split(": ", 1)[-1]]
    for line in after[first + 1:]:
        if not line.strip():
            break
        message.append(line)
    return "hvdtrain: error: horovodrun: " + "".join(message)


def mpirun_boxes(lines: list[str]) -> str | None:
    """mpirun's reports (each between dashed lines, made one line each), except those only saying
    that a worker failed."""
    boxes, box = [], None
    for line in lines:
        if line.startswith("-----"):
            if box:
                boxes.append(box)
            box = [] if box is None else None
        elif box is not None:
            box.append(line)
    wanted = [" ".join("".join(b).split()) for b in boxes if not any(echo in "".join(b) for echo in MPI_ECHO_BOXES)]
    return "".join(f"hvdtrain: error: mpirun: {b}\n" for b in wanted if b) or None
