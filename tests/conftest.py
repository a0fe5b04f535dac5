"""pytest set-up: the `workers` and `deep` markers and the tiny-config fixture (helpers are in helpers.py)."""
import pytest

from helpers import TINY, write_config


def pytest_configure(config):
    config.addinivalue_line("markers", "workers: starts hvdtrain or horovodrun worker processes (slow); "
                                       "`pytest -m 'not workers'` runs the fast tests alone")
    config.addinivalue_line("markers", "deep: a wider grid of a capability whose key equivalence tests run in "
                                       "`make test`, or a second real run of a guarantee that `make test` checks "
                                       "in another case (the mpi twin of a gloo run, a resume across one more "
                                       "level); `make test-deep` runs these (minutes to hours on 2 cores)")


@pytest.fixture
def tiny_config(tmp_path):
    def make(overrides=None, name="config.yaml", base=TINY):
        return write_config(tmp_path / name, overrides, base)
    return make
