"""A full disk reported as one line: the stage, the path, the space free and roughly needed.

Without this, a full working folder ends a run with `OSError: [Errno 28] No space left on
device` (or numpy's errno-less short write) under several tracebacks, from wherever the write
happened (a dask worker, a training rank, SQLite). Where a stage's size is known beforehand,
require_space refuses the workdir before the stage writes anything.
"""

import errno
import re
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from trainflow.errors import TrainflowError

_FULL_ERRNOS = {errno.ENOSPC, errno.EDQUOT}
# How the same error reads once it is text (a remote rank's traceback) or SQLite's wording.
_FULL_TEXTS = ("No space left on device", "Disk quota exceeded", "database or disk is full")
# A short write that carries no errno: numpy's np.save/tofile ("3920000 requested and 2174848
# written") when fwrite stops at a full disk.
_SHORT_WRITE = re.compile(r"\b\d+ requested and \d+ written\b")


class DiskFullError(TrainflowError):
    """A stage ran out of disk space (or quota) under the working folder."""


def is_disk_full(exc: BaseException) -> bool:
    """Whether `exc`, or an error it was raised from, is a full disk or an exceeded quota."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, OSError) and current.errno in _FULL_ERRNOS:
            return True
        # A failed job's rank tracebacks (JobError.detail) hold the chain its one line cuts.
        text = f"{current}\n{getattr(current, 'detail', '')}"
        if any(full in text for full in _FULL_TEXTS) or _SHORT_WRITE.search(text):
            return True
        current = current.__cause__ or current.__context__
    return False


@contextmanager
def disk_stage(stage: str, path: Path, need_bytes: int | None = None) -> Iterator[None]:
    """Turn a full disk met in the block into a DiskFullError naming `stage` and `path`."""
    try:
        yield
    except DiskFullError:
        raise
    except Exception as exc:
        if not is_disk_full(exc):
            raise
        raise DiskFullError(disk_full_message(stage, path, need_bytes)) from exc


def require_space(stage: str, path: Path, need_bytes: int | None) -> None:
    """DiskFullError before `stage` writes about `need_bytes` under `path` when the disk there
    has less free (pre-flight: nothing has been written yet). None: the size is unknown."""
    free = shutil.disk_usage(_existing(path)).free
    if need_bytes is not None and free < need_bytes:
        raise DiskFullError(
            f"{stage}: not enough space on the disk of {path} ({_size(free)} free, about "
            f"{_size(need_bytes)} needed): free some space there, or set workdir to a folder "
            "on a larger disk"
        )


def disk_full_message(stage: str, path: Path, need_bytes: int | None) -> str:
    """One line: what ran out of space where, how much is free and about how much is needed."""
    free = shutil.disk_usage(_existing(path)).free
    need = f", about {_size(need_bytes)} needed" if need_bytes else ""
    return (
        f"{stage}: no space left on the disk of {path} ({_size(free)} free{need}): "
        "free some space there, or set workdir to a folder on a larger disk"
    )


def _existing(path: Path) -> Path:
    """`path` or its nearest existing parent (disk_usage needs an existing path)."""
    path = path.absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def _size(n: float) -> str:
    for unit in ("B", "KiB", "MiB"):
        if n < 1024:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"
