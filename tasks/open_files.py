"""Too many open files (EMFILE) reported as one line whose advice is the limit and how to raise it.

trainflow keeps the number of files it holds open bounded, whatever the shard count (the
writer closes shards as it goes, readers read a shard and close it, streaming keeps a small
cache of open shards). Should the per-process limit (`ulimit -n`) still be too low for what
runs beside it, the error names the limit instead of blaming the data.
"""

import errno
import resource

from trainflow.errors import TrainflowError

_TEXT = "Too many open files"


class TooManyOpenFilesError(TrainflowError):
    """A process reached its limit of open files."""


def too_many_open_files(exc: BaseException) -> bool:
    """Whether `exc`, or an error it was raised from (or a failed job's rank tracebacks),
    is EMFILE/ENFILE."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, OSError) and current.errno in (errno.EMFILE, errno.ENFILE):
            return True
        if _TEXT in f"{current}\n{getattr(current, 'detail', '')}":
            return True
        current = current.__cause__ or current.__context__
    return False


def open_files_advice() -> str:
    """What the limit is here and how to raise it."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    hard_text = "unlimited" if hard == resource.RLIM_INFINITY else str(hard)
    target = 65536 if hard == resource.RLIM_INFINITY else min(hard, 65536)
    raise_it = (
        f"raise it with `ulimit -n {target}` in the shell (or job script) that starts trainflow"
        if soft < target
        else "ask your administrator for a higher hard limit (`ulimit -Hn`)"
    )
    return (
        f"too many open files: this process may hold {soft} (`ulimit -n`; hard limit "
        f"{hard_text}): {raise_it}"
    )
