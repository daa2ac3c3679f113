"""A new local MLflow store is created without a sync per migration, and is a whole store."""

from pathlib import Path

from mlflow.store.tracking.sqlalchemy_store import SqlAlchemyStore
from mlflow.tracking import MlflowClient
from sqlalchemy import create_engine

from trainflow.tasks.tracking.new_store import _unsynced_connections, create_local_store


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
