"""The data cache (`data.cache_dir`, default ~/.cache/hvdtrain): where it is, the keys of its
entries, and writing an entry so that it appears complete or not at all."""
import hashlib
import json
import os
import shutil
import uuid
from contextlib import contextmanager
from pathlib import Path

from hvdtrain.config import DataConfig


def cache_root(cfg: DataConfig) -> Path:
    return Path(cfg.cache_dir).expanduser() if cfg.cache_dir else Path.home() / ".cache" / "hvdtrain"


def cache_key(*parts) -> str:
    """A short stable hash of `parts` (strings, numbers, lists of them): the name of a cache entry."""
    return hashlib.sha256(json.dumps([str(p) for p in parts]).encode()).hexdigest()[:16]


@contextmanager
def atomic_path(target: Path):
    """Yield a temporary path next to `target` to write a file or folder into; once the
    block succeeds it is renamed to `target` in one step, so a crash never leaves a half
    written entry. If another process got there first its copy is kept."""
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{target.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    try:
        yield tmp
        try:
            os.replace(tmp, target)
        except OSError:
            if not target.exists():
                raise
    finally:
        if tmp.is_dir():
            shutil.rmtree(tmp)
        elif tmp.exists():
            tmp.unlink()
