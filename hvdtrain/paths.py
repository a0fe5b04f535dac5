"""Folders hvdtrain writes to, checked before anything is written, and writes that fail cleanly.

A path a user gives that cannot be used (a file where a folder is needed, a read-only place)
is one line naming the config key or option; a write that fails half way (a full disk, a
quota) is one line naming what was being written, and leaves nothing half-written behind.
"""
import os
import shutil
from contextlib import contextmanager
from pathlib import Path

from safetensors import SafetensorError

from hvdtrain.errors import UserError


def check_writable_folder(path, what: str):
    """`path` is, or can be made, a folder this process may write into."""
    p = Path(path).expanduser()
    if p.exists() and not p.is_dir():
        raise UserError(f"{what} '{path}' is a file, not a folder")
    existing = next(a for a in (p, *p.parents) if a.exists())
    if not existing.is_dir():
        raise UserError(f"{what} '{path}': '{existing}' is a file, not a folder")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise UserError(f"{what} '{path}': '{existing}' is not writable")


@contextmanager
def written_whole(what: str, leftover: Path):
    """Turn a failed write (OSError, or safetensors' own error for one) into one line; remove
    the partial output `leftover`."""
    try:
        yield
    except (OSError, SafetensorError) as e:
        shutil.rmtree(leftover, ignore_errors=True)
        reason = e.strerror if isinstance(e, OSError) and e.strerror else str(e).splitlines()[0]
        raise UserError(f"could not write {what}: {reason}; nothing of it was kept") from None
