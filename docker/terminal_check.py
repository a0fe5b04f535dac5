"""docker/test-image.sh's terminal check: `hvdtrain launch` inside the container, run on a
pseudo-terminal as a user runs it, shows one clean stream (rank 0's lines untagged, one progress
bar redrawn in place, the summary line below it), as tests/test_launch.py checks it on the host.

    python docker/terminal_check.py STEPS OUT_DIR COMMAND...

OUT_DIR: the run folder as the run names it (inside the container). The screen is printed."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from helpers import assert_one_clean_stream, run_on_terminal  # noqa: E402

steps, out, command = int(sys.argv[1]), Path(sys.argv[2]), sys.argv[3:]
code, raw, screen = run_on_terminal(command, timeout=600)
assert code == 0, f"exit code {code}:\n{raw[-3000:]}"
print("\n".join(assert_one_clean_stream(screen, raw, steps, out)))
