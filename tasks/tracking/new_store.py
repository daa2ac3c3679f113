"""A new local SQLite MLflow store: a copy of a migrated empty store, else created by MLflow
without a disk sync per schema migration.

MLflow creates a SQLite store by running its schema migrations one transaction at a time: 271
commits, each synced to disk (journal and database: ~1,080 fdatasync calls, 1,226 of the 1,260
a whole `trainflow run --preset tiny` made in a new workdir, measured with strace), and ~0.7
CPU s of Alembic work (this 2-core EPYC) in every new workdir.

The first store a machine's MLflow version creates is made by MLflow itself, its connections
opened with `PRAGMA synchronous=OFF` (the store is new and holds nothing yet); then the file is
synced once and those connections are closed, and every later connection syncs its commits as
SQLite does by default. A copy of it without its Default experiment is kept as a template in
the user's cache (tasks.cache_dir, one file per MLflow version: the schema is the version's).
Later new stores are a copy of the template, renamed into place whole (0.04 instead of 0.7 CPU
s); MLflow then opens it, finds the schema current and creates the Default experiment with this
workdir's artifact root, as it does in a store it created. A template that cannot be written or
read is no error: the store is created as before.
"""

import os
import shutil
import sqlite3
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any

from trainflow.tasks.cache_dir import cache_root
from trainflow.tasks.tracking.store_lock import sqlite_path


def template_path() -> Path:
    """This MLflow version's template (it may not exist yet), in the cache's mlflow-stores/."""
    import mlflow

    return cache_root() / "mlflow-stores" / f"mlflow-{mlflow.__version__}.db"


def create_local_store(tracking_uri: str, artifact_root: Path) -> bool:
    """Create the SQLite store of `tracking_uri` (schema and MLflow's Default experiment, whose
    artifacts go under `artifact_root`) when its file does not exist yet; True if it did so.
    Other stores are left to MLflow. Call it under store_lock (one creator at a time)."""
    db = sqlite_path(tracking_uri)
    if db is None or db.exists():
        return False
    from mlflow.store.tracking.sqlalchemy_store import SqlAlchemyStore

    db.parent.mkdir(parents=True, exist_ok=True)
    root = artifact_root.resolve().as_uri()
    if seed_store(db):
        try:
            SqlAlchemyStore(tracking_uri, root).engine.dispose()  # the Default experiment
            return True
        except Exception:  # MLflow refuses the copy: drop it and the template, create anew
            engine = getattr(SqlAlchemyStore, "_engine_map", {}).pop(tracking_uri, None)
            if engine is not None:
                engine.dispose()  # its pooled connections hold the dropped file
            db.unlink(missing_ok=True)
            template_path().unlink(missing_ok=True)
    with _unsynced_connections(db):
        store = SqlAlchemyStore(tracking_uri, root)
    store.engine.dispose()  # the unsynced connections: later ones sync as usual
    _sync(db)
    _save_template(db)
    return True


def seed_store(db: Path) -> bool:
    """Put a copy of the template at `db` (which must not exist), whole or not at all; False
    when there is no template to copy. Also for an `mlflow server`'s new store: the server
    opens it as one of its own and creates its Default experiment with its artifact root."""
    template = template_path()
    if not template.is_file():
        return False
    if not _sound(template):
        template.unlink(missing_ok=True)  # made anew by the next store MLflow creates
        return False
    tmp = db.with_name(f".{db.name}.seed-{os.getpid()}")
    try:
        shutil.copyfile(template, tmp)
        _sync(tmp)
        os.link(tmp, db)  # fails if `db` appeared meanwhile: never overwrites a store
    except OSError:
        return False
    finally:
        tmp.unlink(missing_ok=True)
    return True


def _save_template(db: Path) -> None:
    """Keep a copy of the new store `db`, without its Default experiment, as the template; a
    template already there (another process's) is kept. Never raises."""
    template = template_path()
    if template.exists():
        return
    with suppress(OSError, sqlite3.Error):
        template.parent.mkdir(parents=True, exist_ok=True)
        fd, name = tempfile.mkstemp(dir=template.parent, prefix=".template-", suffix=".db")
        os.close(fd)
        tmp = Path(name)
        try:
            shutil.copyfile(db, tmp)
            with sqlite3.connect(tmp) as conn:
                conn.execute("DELETE FROM experiment_tags")
                conn.execute("DELETE FROM experiments")
            conn.close()
            _sync(tmp)
            os.replace(tmp, template)
        finally:
            tmp.unlink(missing_ok=True)


def sqlite_answers(path: Path, *queries: str) -> list[Any] | None:
    """The first row of each query on the database `path`, opened read-only after SQLite's
    quick_check passed; None when it fails or the file is no database (or lacks a table)."""
    try:
        conn = sqlite3.connect(f"{path.as_uri()}?mode=ro&immutable=1", uri=True)
        try:
            if conn.execute("PRAGMA quick_check").fetchone() != ("ok",):
                return None
            return [conn.execute(query).fetchone() for query in queries]
        finally:
            conn.close()
    except sqlite3.Error:
        return None


def _sound(template: Path) -> bool:
    """Whether `template` is a whole SQLite database with MLflow's tables and no experiment."""
    answers = sqlite_answers(
        template, "SELECT count(*) FROM experiments", "SELECT count(*) FROM alembic_version"
    )
    return answers == [(0,), (1,)]


def _sync(path: Path) -> None:
    with path.open("rb+") as f:
        os.fsync(f.fileno())


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
