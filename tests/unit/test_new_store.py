"""A new local MLflow store is created without a sync per migration, later ones are copies of
a migrated template, and each is a whole store."""

import logging
import sqlite3
from pathlib import Path

import pytest
from mlflow.store.tracking.sqlalchemy_store import SqlAlchemyStore
from mlflow.tracking import MlflowClient
from sqlalchemy import create_engine

from trainflow.tasks.tracking.new_store import (
    _unsynced_connections,
    create_local_store,
    seed_store,
    template_path,
)


def _synchronous(path: Path) -> int:
    with create_engine(f"sqlite:///{path}").connect() as conn:
        return int(conn.exec_driver_sql("PRAGMA synchronous").scalar_one())


def test_only_connections_to_the_new_store_skip_syncs_and_only_while_it_is_created(
    tmp_path: Path,
) -> None:
    new, other = tmp_path / "new.db", tmp_path / "other.db"
    full = _synchronous(other)  # SQLite's default (FULL, 2)
    assert full == 2
    with _unsynced_connections(new):
        assert _synchronous(new) == 0
        assert _synchronous(other) == full
    assert _synchronous(new) == full


def test_the_created_store_is_mlflows_own_and_an_existing_one_is_left_alone(
    tmp_path: Path,
) -> None:
    uri = f"sqlite:///{tmp_path / 'work' / 'mlflow.db'}"
    assert create_local_store(uri, tmp_path / "work" / "mlartifacts")
    client = MlflowClient(uri)
    default = client.get_experiment("0")
    assert default.name == "Default"
    assert default.artifact_location == (tmp_path / "work" / "mlartifacts" / "0").as_uri()
    run = client.create_run(client.create_experiment("e")).info.run_id
    client.log_metric(run, "loss", 0.5)
    assert [m.value for m in client.get_metric_history(run, "loss")] == [0.5]
    # MLflow finds the schema current (a stale one would make it raise or migrate).
    store = SqlAlchemyStore(uri, (tmp_path / "elsewhere").as_uri())
    with store.engine.connect() as conn:
        assert conn.exec_driver_sql("PRAGMA integrity_check").scalar_one() == "ok"
        assert conn.exec_driver_sql("PRAGMA synchronous").scalar_one() == 2

    assert not create_local_store(uri, tmp_path / "elsewhere")  # exists: untouched
    assert client.get_experiment_by_name("e") is not None
    assert not create_local_store("http://127.0.0.1:5000", tmp_path)  # a server: MLflow's


class _Kept(logging.Handler):
    """Keeps the messages of the records it handles."""

    def __init__(self) -> None:
        super().__init__()
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def _created_by_mlflow(uri: str, artifacts: Path) -> bool:
    """create_local_store(uri, artifacts) (asserted True); whether MLflow migrated a schema."""
    handler = _Kept()
    logger = logging.getLogger("mlflow.store.db.utils")  # MLflow's loggers do not propagate
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        assert create_local_store(uri, artifacts)
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
    return any("Creating initial MLflow database tables" in m for m in handler.messages)


def _experiments(db: Path) -> list[tuple[str, str]]:
    with sqlite3.connect(db) as conn:
        rows = conn.execute("SELECT name, artifact_location FROM experiments").fetchall()
    conn.close()
    return [(str(name), str(location)) for name, location in rows]


def test_later_stores_are_copies_of_a_template_and_whole_mlflow_stores(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TRAINFLOW_CACHE", str(tmp_path / "cache"))
    template = template_path()
    assert template.parent == tmp_path / "cache" / "mlflow-stores" and not template.exists()
    first, second = tmp_path / "a", tmp_path / "b"
    assert _created_by_mlflow(f"sqlite:///{first / 'mlflow.db'}", first / "art")
    assert template.is_file() and _experiments(template) == []  # no Default experiment kept
    uri = f"sqlite:///{second / 'mlflow.db'}"
    assert not _created_by_mlflow(uri, second / "art")  # a copy: nothing migrated
    assert _experiments(second / "mlflow.db") == [("Default", (second / "art" / "0").as_uri())]
    assert not list(second.glob(".*seed*"))  # no copy left half-way
    client = MlflowClient(uri)
    run = client.create_run(client.create_experiment("e")).info.run_id
    client.log_metric(run, "loss", 0.25)
    assert [m.value for m in client.get_metric_history(run, "loss")] == [0.25]
    store = SqlAlchemyStore(uri, (tmp_path / "elsewhere").as_uri())  # MLflow: schema current
    with store.engine.connect() as conn:
        assert conn.exec_driver_sql("PRAGMA integrity_check").scalar_one() == "ok"
    assert _experiments(template) == []  # the template is never written through


def test_a_damaged_template_is_replaced_and_an_unwritable_cache_is_no_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TRAINFLOW_CACHE", str(tmp_path / "cache"))
    template = template_path()
    template.parent.mkdir(parents=True)
    template.write_bytes(b"not a database" * 100)
    work = tmp_path / "w"
    assert _created_by_mlflow(f"sqlite:///{work / 'mlflow.db'}", work / "art")
    assert MlflowClient(f"sqlite:///{work / 'mlflow.db'}").get_experiment("0").name == "Default"
    assert _experiments(template) == []  # made anew from the store MLflow created

    with sqlite3.connect(template) as conn:  # whole, but a schema MLflow does not know
        conn.execute("UPDATE alembic_version SET version_num = 'f00000000000'")
    conn.close()
    again = tmp_path / "again"
    assert _created_by_mlflow(f"sqlite:///{again / 'mlflow.db'}", again / "art")
    assert MlflowClient(f"sqlite:///{again / 'mlflow.db'}").get_experiment("0").name == "Default"
    with sqlite3.connect(template) as conn:
        assert conn.execute("SELECT version_num FROM alembic_version").fetchone() != (
            "f00000000000",
        )
    conn.close()

    (tmp_path / "file").write_text("")
    monkeypatch.setenv("TRAINFLOW_CACHE", str(tmp_path / "file"))  # no folder can be made there
    other = tmp_path / "o"
    assert _created_by_mlflow(f"sqlite:///{other / 'mlflow.db'}", other / "art")
    assert not seed_store(tmp_path / "x.db") and not (tmp_path / "x.db").exists()
