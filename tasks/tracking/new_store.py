"""A new local SQLite MLflow store, created without a disk sync per schema migration.

MLflow creates a SQLite store by running its schema migrations one transaction at a time: 271
commits, each synced to disk (journal and database: ~1,080 fdatasync calls, 1,226 of the 1,260
a whole `trainflow run --preset tiny` made in a new workdir, measured with strace). On a disk
busy with other writes each sync can take tens of milliseconds. The store is new and holds
nothing yet, so its connections are opened with `PRAGMA synchronous=OFF` while MLflow creates
it; then the file is synced once and those connections are closed, and every later connection
syncs its commits as SQLite does by default. A crash of this process leaves a consistent file
(synchronous only matters when the operating system goes down); should the machine go down
during the creation, the store held nothing: delete it and run again.
"""

import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from trainflow.tasks.tracking.store_lock import sqlite_path


def create_local_store(tracking_uri: str, artifact_root: Path) -> bool:
    """Create the SQLite store of `tracking_uri` (schema and MLflow's Default experiment, whose
    artifacts go under `artifact_root`) when its file does not exist yet; True if it did so.
    Other stores are left to MLflow. Call it under store_lock (one creator at a time)."""
    db = sqlite_path(tracking_uri)
    if db is None or db.exists():
        return False
    from mlflow.store.tracking.sqlalchemy_store import SqlAlchemyStore

    db.parent.mkdir(parents=True, exist_ok=True)
    with _unsynced_connections(db):
        store = SqlAlchemyStore(tracking_uri, artifact_root.resolve().as_uri())
    store.engine.dispose()  # the unsynced connections: later ones sync as usual
    with db.open("rb+") as f:
        os.fsync(f.fileno())
    return True


@contextmanager
def _unsynced_connections(db: Path) -> Iterator[None]:
    """New SQLAlchemy connections to `db` inside the block commit without syncing."""
    from sqlalchemy import event
    from sqlalchemy.engine import Engine

    def unsynced(dbapi_connection: Any, _record: Any) -> None:
        cursor = dbapi_connection.cursor()
        try:
            [(_seq, _name, path)] = cursor.execute("PRAGMA database_list").fetchall()[:1]
            if path and Path(path).resolve() == db.resolve():
                cursor.execute("PRAGMA synchronous=OFF")
        finally:
            cursor.close()

    event.listen(Engine, "connect", unsynced)
    try:
        yield
    finally:
        event.remove(Engine, "connect", unsynced)
