"""The share of a run's time that its workers spent in one kind of Horovod operation, read from
the run's Horovod timeline (horovod.timeline=FILE):

    python scripts/timeline_share.py RUN/timeline.json [--op alltoall]

Each operation of the timeline is a row of events (a "process" named after the tensor, e.g.
alltoall.noname.12): its negotiation (waiting until every rank has submitted it) and then the
operation itself, one after the other. A worker is blocked in an alltoall from its submission to
its end, so the time spent in that kind of operation is the sum of those spans, and the share is
that over the time from the first such operation's start to the last one's end (the training
steps, where every step runs them). Prints one line of JSON."""
import argparse
import json
from pathlib import Path


def read_events(path: Path) -> list[dict]:
    """The timeline's events; Horovod leaves the JSON array open while it writes."""
    text = path.read_text().strip().rstrip(",")
    return json.loads(text if text.endswith("]") else text + "]")


def share(events: list[dict], op: str) -> dict:
    names = {e["pid"]: e["args"]["name"] for e in events if e.get("name") == "process_name" and "name" in e["args"]}
    rows = {pid for pid, name in names.items() if name.startswith(op + ".")}
    spans, depth, start = [], {}, {}
    for e in events:
        pid = e.get("pid")
        if pid not in rows or e["ph"] not in "BE":
            continue
        if e["ph"] == "B":
            if depth.get(pid, 0) == 0:
                start[pid] = e["ts"]
            depth[pid] = depth.get(pid, 0) + 1
        else:
            depth[pid] -= 1
            if depth[pid] == 0:
                spans.append((start[pid], e["ts"]))
    # a negotiation and its operation are consecutive spans of one row: merged by the sum
    busy = sum(end - begin for begin, end in spans)
    window = max(end for _, end in spans) - min(begin for begin, _ in spans)
    return {"op": op, "operations": len(rows), "busy_s": busy / 1e6, "window_s": window / 1e6,
            "share": busy / window}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("timeline", type=Path)
    parser.add_argument("--op", default="alltoall", help="the operations' name prefix (default alltoall)")
    args = parser.parse_args()
    print(json.dumps(share(read_events(args.timeline), args.op)))


if __name__ == "__main__":
    main()
