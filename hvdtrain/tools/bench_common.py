"""What the benchmark commands share: option parsing, the tag of a worker's result line, and
this process's memory from /proc. No torch here (the CLI imports the benchmarks)."""
from pathlib import Path

from hvdtrain.errors import UserError

RESULT_TAG = "hvdtrain-bench-result: "  # marks the line a benchmark worker reports its result on


def parse_ints(text: str, what: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",")]
    except ValueError:
        values = []
    if not values or min(values) < 1:
        raise UserError(f"{what}: expected comma-separated integers >= 1, got '{text}'")
    return values


def proc_status_bytes(field: str) -> int:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    import resource
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
