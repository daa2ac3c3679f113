"""The MLflow run tree of one pipeline run: a parent run and one child run per stage.

Runs end FINISHED on success, FAILED on an error and KILLED on cancellation (Ctrl-C or a
cancelled flow run), so nothing is left RUNNING. When the tracking server is gone, marking a
run FAILED or KILLED is skipped with a warning instead of retried: the error that ends the
flow comes out at once (tasks.tracking.reachability).
"""

import logging
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from mlflow.tracking import MlflowClient

from trainflow.tasks.diskspace import disk_stage
from trainflow.tasks.tracking import runs
from trainflow.tasks.tracking.config import TrackingConfig, resolve_tracking_uri
from trainflow.tasks.tracking.reachability import limit_http_retries, reachable
from trainflow.tasks.tracking.store_lock import sqlite_path, store_lock


def create_local_store(tracking_uri: str, artifact_root: Path) -> None:
    """Create the SQLite store of `tracking_uri` when its file does not exist yet, with MLflow's
    Default experiment keeping its artifacts under `artifact_root` (not the working folder).
    Other stores are left to MLflow. Call it under store_lock (one creator at a time)."""
    db = sqlite_path(tracking_uri)
    if db is None or db.exists():
        return
    from mlflow.store.tracking.sqlalchemy_store import SqlAlchemyStore

    db.parent.mkdir(parents=True, exist_ok=True)
    SqlAlchemyStore(tracking_uri, artifact_root.resolve().as_uri()).engine.dispose()


def status_for(exc: BaseException) -> str:
    """KILLED for cancellation (interrupts, signals), FAILED for errors."""
    # Cancellation reaches us as KeyboardInterrupt/SystemExit (Ctrl-C) or as a
    # BaseException subclass Prefect raises to abort the flow; errors are Exceptions.
    return "FAILED" if isinstance(exc, Exception) else "KILLED"


def quiet_store_setup() -> None:
    """Keep MLflow's INFO lines about creating and migrating a new database store ("Creating
    initial MLflow database tables...", "Updating database tables") out of the flow log: they
    are library chatter on every first run in a workdir. Its warnings and errors still show."""
    logging.getLogger("mlflow.store.db.utils").setLevel(logging.WARNING)


class PipelineRuns:
    """Creates and closes the parent and stage runs of one pipeline run."""

    def __init__(
        self, cfg: TrackingConfig, workdir: Path, name: str, parent_id: str | None = None
    ) -> None:
        """A new parent run named `name`; or, given `parent_id`, that earlier one again
        (`trainflow resume`: RUNNING again, its stages continued with `resume_stage`)."""
        limit_http_retries()
        quiet_store_setup()
        self.tracking_uri = resolve_tracking_uri(cfg, workdir)
        self.experiment = cfg.experiment
        # A new SQLite store is ~1 MiB, and as much again for its journal while it is created.
        with disk_stage("tracking store", workdir, 2 << 20), store_lock(self.tracking_uri):
            create_local_store(self.tracking_uri, workdir / "mlartifacts")
            self.client = MlflowClient(self.tracking_uri)
            self.experiment_id = runs.ensure_experiment(self.client, cfg.experiment, workdir)
        self.commit = runs.git_commit()
        if parent_id is None:
            parent_id = runs.create_run(
                self.client, self.experiment_id, name, tags={"git_commit": self.commit}
            )
        else:
            runs.reopen_run(self.client, parent_id)
        self.parent_id = parent_id
        self.stage_ids: dict[str, str] = {}
        """Run id of each stage opened so far, by stage name."""

    @contextmanager
    def parent(self, params: dict[str, str]) -> Iterator[str]:
        """Scope of the parent run: params logged first, status set on exit."""
        runs.log_params(self.client, self.parent_id, params)
        with self._closing(self.parent_id):
            yield self.parent_id

    @contextmanager
    def resume_parent(self) -> Iterator[str]:
        """Scope of a resumed parent run: its params stay as logged, status set on exit."""
        with self._closing(self.parent_id):
            yield self.parent_id

    @contextmanager
    def stage(self, name: str, params: dict[str, str]) -> Iterator[str]:
        """A child run for one stage, closed with the stage's outcome."""
        run_id = self.open_stage(name, params)
        with self._closing(run_id):
            yield run_id

    @contextmanager
    def resume_stage(self, name: str, run_id: str | None, params: dict[str, str]) -> Iterator[str]:
        """The stage run `run_id` of an earlier attempt of this pipeline run, RUNNING again
        and closed with the stage's outcome (a new one when it has none: it never started)."""
        if run_id is None:
            with self.stage(name, params) as new_id:
                yield new_id
            return
        runs.reopen_run(self.client, run_id)
        self.stage_ids[name] = run_id
        with self._closing(run_id):
            yield run_id

    def open_stage(self, name: str, params: dict[str, str]) -> str:
        """Create a RUNNING child run; the caller closes it with close()."""
        run_id = runs.create_run(
            self.client,
            self.experiment_id,
            name,
            parent_id=self.parent_id,
            tags={"git_commit": self.commit, "stage": name},
        )
        runs.log_params(self.client, run_id, params)
        self.stage_ids[name] = run_id
        return run_id

    def close(self, run_id: str, outcome: BaseException | None = None) -> None:
        """End a run: FINISHED without an outcome, else FAILED or KILLED by its kind."""
        if outcome is None:
            runs.finish_run(self.client, run_id, "FINISHED")
        else:
            self._end_after_error(run_id, status_for(outcome))

    def tag(self, run_id: str, tags: dict[str, str]) -> None:
        """Set tags on one run of the tree."""
        runs.set_tags(self.client, run_id, tags)

    @contextmanager
    def _closing(self, run_id: str) -> Iterator[None]:
        try:
            yield
        except BaseException as exc:
            self._end_after_error(run_id, status_for(exc))
            raise
        runs.finish_run(self.client, run_id, "FINISHED")

    def _end_after_error(self, run_id: str, status: str) -> None:
        """Mark a run FAILED or KILLED; never raise, never wait long: an error is under way."""
        if not reachable(self.tracking_uri):
            _warn(f"run {run_id} not marked {status}: {self.tracking_uri} is unreachable")
            return
        try:
            runs.finish_run(self.client, run_id, status)
        except Exception as exc:
            _warn(f"run {run_id} not marked {status}: {type(exc).__name__}: {exc}"[:400])

    def log_summary(self, run_id: str, values: dict[str, float]) -> None:
        """Headline numbers on the parent run (e.g. test accuracy, stage seconds)."""
        runs.log_metrics(self.client, run_id, values)


def _warn(text: str) -> None:
    print(f"trainflow: warning: MLflow {text}", file=sys.stderr, flush=True)
