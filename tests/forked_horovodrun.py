"""`horovodrun` for the tests, without its three seconds of start-up at every launch.

Most of a `horovodrun`'s start is Horovod asking whether it was built with Gloo (or MPI): the
check starts a Python child that imports horovod.torch, and so torch; Horovod caches the answer
in the launcher's process alone. Here one server process, started with the first launch, loads
Horovod's launcher and asks once, for real; every launch is a fork of it that runs Horovod's own
entry point, `run_commandline`, as the `horovodrun` script does, with the test's arguments,
environment and working folder, its output in files. The workers are started by Horovod's
launcher exactly as under `horovodrun` (measured: 3.4 s for a one-worker launch of
`python -c pass`, 0.4 s forked).

The server is this file run as a script: it reads a pickled request per launch on its standard
input and answers two lines on its standard output, the launch's pid and then its exit code.
"""
import atexit
import os
import pickle
import select
import signal
import subprocess
import sys
import tempfile
import threading
import traceback
from pathlib import Path


def _horovodrun(run_commandline, argv: list[str], env: dict, cwd: str, stdout: str, stderr: str):
    """In the forked launch: what `python horovodrun ARGS` does in a process of its own."""
    for fd, path in ((0, os.devnull), (1, stdout), (2, stderr)):
        with open(path, "rb" if fd == 0 else "wb") as f:
            os.dup2(f.fileno(), fd)
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    sys.argv = argv
    code = 0
    try:
        run_commandline()
    except SystemExit as stop:  # the interpreter's rule: None is 0, a number itself, else printed and 1
        code = stop.code if isinstance(stop.code, int) else 0 if stop.code is None else 1
        if not isinstance(stop.code, (int, type(None))):
            print(stop.code, file=sys.stderr)
    except BaseException:  # as an uncaught exception ends the script: its traceback, exit 1
        traceback.print_exc()
        code = 1
    atexit._run_exitfuncs()  # as the interpreter's exit: multiprocessing releases what the launcher made
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def serve():
    """The server: Horovod's launcher loaded, its build asked about once, then a fork per request."""
    from horovod.common.util import gloo_built, mpi_built
    from horovod.runner.launch import run_commandline

    # Asked with the arguments Horovod's launcher asks with (launch.run_controller and
    # launch.is_gloo_used), so that the cached answers serve every launch forked from here.
    gloo_built(verbose=False)
    mpi_built(verbose=False)
    mpi_built()
    requests, replies = sys.stdin.buffer, sys.stdout.fileno()
    while True:
        try:
            request = pickle.load(requests)
        except EOFError:  # the tests are over
            return
        pid = os.fork()
        if pid == 0:
            _horovodrun(run_commandline, **request)
        os.write(replies, b"%d\n" % pid)
        _, status = os.waitpid(pid, 0)
        os.write(replies, b"%d\n" % os.waitstatus_to_exitcode(status))


_server: subprocess.Popen | None = None
_one_at_a_time = threading.Lock()


def _reply(timeout: float | None = None) -> int | None:
    """The server's next line (a number), or None if it did not come within `timeout` seconds."""
    fd, line = _server.stdout.fileno(), b""
    while not line.endswith(b"\n"):
        if not select.select([fd], [], [], timeout)[0]:
            return None
        byte = os.read(fd, 1)  # a byte at a time: the next line stays unread
        if not byte:
            raise RuntimeError("the tests' horovodrun server ended (its error is above)")
        line += byte
    return int(line)


def _stop_server():
    _server.stdin.close()
    _server.wait()


def run(argv: list[str], env: dict, cwd: Path, timeout: float) -> subprocess.CompletedProcess:
    """`argv` (horovodrun's path, then its arguments) run to its end, as subprocess.run with
    capture_output=True, text=True does: on a timeout the launcher is killed (Horovod's launcher
    then stops its workers) and subprocess.TimeoutExpired raised."""
    global _server
    with _one_at_a_time, tempfile.TemporaryDirectory(prefix="horovodrun-") as out:
        if _server is None:
            _server = subprocess.Popen([sys.executable, __file__], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
            atexit.register(_stop_server)
        stdout, stderr = Path(out, "stdout"), Path(out, "stderr")
        pickle.dump(dict(argv=argv, env=env, cwd=str(cwd), stdout=str(stdout), stderr=str(stderr)), _server.stdin)
        _server.stdin.flush()
        pid = _reply()
        code = _reply(timeout)
        if code is None:
            os.kill(pid, signal.SIGKILL)
            _reply()
            raise subprocess.TimeoutExpired(argv, timeout, output=stdout.read_text(), stderr=stderr.read_text())
        return subprocess.CompletedProcess(argv, code, stdout.read_text(), stderr.read_text())


if __name__ == "__main__":
    serve()
