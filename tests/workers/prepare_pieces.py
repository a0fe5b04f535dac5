"""Test worker: `hvdtrain prepare CONFIG [key=value ...]`, alone or as one of horovodrun's
workers, with pieces of PIECE_CHARS characters (the first argument) so that tiny test
corpora still make many pieces."""
import sys

from hvdtrain import cli
from hvdtrain.data import preparation

if __name__ == "__main__":
    preparation.PIECE_CHARS = int(sys.argv[1])
    sys.exit(cli.main(["prepare", *sys.argv[2:]]))
