"""Test worker: `hvdtrain prepare CONFIG [key=value ...]`, alone or as one of horovodrun's
workers, with pieces of PIECE_CHARS characters (the first argument) so that tiny test
corpora still make many pieces."""
import argparse
import logging
import sys

from hvdtrain import prepare
from hvdtrain.data import preparation

if __name__ == "__main__":
    preparation.PIECE_CHARS = int(sys.argv[1])
    logging.basicConfig(format="hvdtrain: %(message)s", stream=sys.stdout)
    logging.getLogger("hvdtrain").setLevel(logging.INFO)
    sys.exit(prepare.run_prepare(argparse.Namespace(config=sys.argv[2], overrides=sys.argv[3:])))
