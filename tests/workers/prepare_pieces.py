"""Test worker: `hvdtrain prepare CONFIG [key=value ...]`, alone or as one of horovodrun's
workers, with pieces of PIECE_CHARS characters (the first argument) so that tiny test
corpora still make many pieces.

With PREPARE_AFTER_MEMBER_0=FILE in the environment, member 1 of the group starts reading the
corpus only once member 0 has tokenized all of its pieces (member 0 then creates FILE): the
members see the data.max_tokens cut reached at different pieces."""
import os
import sys
import time
from pathlib import Path

from hvdtrain import cli
from hvdtrain.data import preparation


def member_1_after_member_0(flag: Path):
    tokenize_share = preparation._tokenize_share

    def in_turn(plan, group, *args):
        if group.rank == 1:
            while not flag.exists():
                time.sleep(0.05)
        counts = tokenize_share(plan, group, *args)
        if group.rank == 0:
            flag.touch()
        return counts
    preparation._tokenize_share = in_turn


if __name__ == "__main__":
    preparation.PIECE_CHARS = int(sys.argv[1])
    if "PREPARE_AFTER_MEMBER_0" in os.environ:
        member_1_after_member_0(Path(os.environ["PREPARE_AFTER_MEMBER_0"]))
    sys.exit(cli.main(["prepare", *sys.argv[2:]]))
