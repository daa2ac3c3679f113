"""Worker tasks whose bad-input error comes back as a value: one line for the client to report,
instead of a worker-side traceback per task."""

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from trainflow.errors import DataError
from trainflow.tasks.open_files import open_files_advice, too_many_open_files

T = TypeVar("T")


@dataclass(frozen=True)
class Failure:
    """A DataError raised on a worker, carried back as a value (no worker-side traceback)."""

    message: str


def run_guarded(fn: Callable[..., T], *args: Any) -> "T | Failure":
    """fn(*args), or a Failure holding the message of the DataError it raised (or of the
    worker's open-files limit, reached: its advice is the limit, not the data)."""
    try:
        return fn(*args)
    except DataError as exc:
        return Failure(str(exc))
    except OSError as exc:
        if not too_many_open_files(exc):
            raise
        return Failure(f"preprocess (a dask worker): {open_files_advice()}")
