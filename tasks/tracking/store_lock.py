"""One process at a time creates a local MLflow store and its experiment.

MLflow creates a SQLite store's schema on first use; three `trainflow run` started at once on
a new working folder each tried, and one failed with `table secrets already exists`. Creating
an experiment races the same way (`already exists`). The first use of a local store is taken
under an exclusive lock on a file next to it; later uses of an existing store wait only for a
process that is creating it.
"""

import fcntl
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


def sqlite_path(tracking_uri: str) -> Path | None:
    """The database file of a `sqlite:///` tracking URI, else None."""
    if not tracking_uri.startswith("sqlite:///"):
        return None
    path = tracking_uri.removeprefix("sqlite:///").split("?")[0]  # SQLAlchemy's spelling
    return Path(path) if path and path != ":memory:" else None


@contextmanager
def store_lock(tracking_uri: str) -> Iterator[None]:
    """Hold an exclusive lock for a SQLite store (its folder is created); no-op for others."""
    db = sqlite_path(tracking_uri)
    if db is None:
        yield
        return
    db.parent.mkdir(parents=True, exist_ok=True)
    with (db.parent / f"{db.name}.lock").open("a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)
