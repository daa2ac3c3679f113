"""A pipeline run's record in its folder, `<workdir>/runs/<parent run id>/pipeline.json`:
what `trainflow resume` needs to continue the run where it stopped (flows.resume).

Written when the run starts and updated as its stages begin: the resolved config, the MLflow
store and runs, the dataset's content hash, the code snapshot, and the process that runs it.
It lives beside the run's checkpoints and job files, so a run can be continued from its folder
alone, whether or not the tracking server was reachable when it stopped.
"""

import json
import os
import socket
import time
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError

from trainflow.errors import ConfigError

FILE = "pipeline.json"
"""The record's name in the run's folder."""


class RunRecord(BaseModel):
    """What a pipeline run was, and how far it got."""

    model_config = ConfigDict(extra="ignore")

    parent_run_id: str
    """The MLflow parent run (also the run folder's name)."""
    tracking_uri: str
    """The MLflow store of its runs."""
    config: dict[str, Any]
    """The resolved PipelineConfig, as JSON."""
    host: str
    """The host of the flow process running it."""
    pid: int
    """That process's id (a run whose process lives on this host is not resumed)."""
    started: float
    """When the record was first written (seconds since the epoch)."""
    dataset_hash: str | None = None
    """The content hash of the dataset it trained on, once preprocessed."""
    code_hash: str | None = None
    """The hash of the user's code snapshot, if it took one."""
    code_paths: list[Path] = []
    """The snapshot's folders (put first on sys.path by every rank)."""
    train_run_id: str | None = None
    """The train stage's MLflow run, once opened."""


def write_record(run_dir: Path, record: RunRecord) -> None:
    """Write the record atomically (a reader sees the old one or the new one)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    tmp = run_dir / f".{FILE}.tmp"
    tmp.write_text(record.model_dump_json(indent=2))
    os.replace(tmp, run_dir / FILE)


def new_record(run_dir: Path, parent_run_id: str, tracking_uri: str, config: str) -> RunRecord:
    """The record of a run starting now in this process (`config`: the config as JSON)."""
    record = RunRecord(
        parent_run_id=parent_run_id,
        tracking_uri=tracking_uri,
        config=json.loads(config),
        host=socket.gethostname(),
        pid=os.getpid(),
        started=time.time(),
    )
    write_record(run_dir, record)
    return record


def update_record(run_dir: Path, record: RunRecord, **fields: Any) -> RunRecord:
    """The record with `fields` changed, written."""
    record = record.model_copy(update=fields)
    write_record(run_dir, record)
    return record


def read_record(run_dir: Path) -> RunRecord:
    """The record of the run in `run_dir`; ConfigError naming what is missing."""
    path = run_dir / FILE
    if not path.is_file():
        raise ConfigError(
            f"{run_dir} holds no pipeline run ({FILE} missing): give a run folder "
            "<workdir>/runs/<run id> of `trainflow run`, or its MLflow parent run id (a search "
            "continues by running its command again: its study keeps its trials)"
        )
    try:
        return RunRecord.model_validate_json(path.read_text())
    except (ValidationError, ValueError) as err:
        raise ConfigError(f"{path} is not a pipeline run's record: {err}") from None


def find_run(target: str, workdir: Path) -> Path:
    """The run folder `target` names: a folder, or a parent run id under `workdir`/runs."""
    folder = Path(target)
    if folder.is_dir():
        return folder.resolve()
    under = workdir / "runs" / target
    if under.is_dir():
        return under.resolve()
    raise ConfigError(
        f"no run folder {target!r} and no run {target!r} under {workdir / 'runs'}: give the "
        "folder `trainflow run` printed, or the parent run id with --workdir where it ran"
    )


def still_running(record: RunRecord) -> bool:
    """Whether the flow process that ran it is alive on this host (a process with its id
    started after the record is another one)."""
    import psutil

    if record.host != socket.gethostname() or record.pid == os.getpid():
        return False
    try:
        return bool(psutil.Process(record.pid).create_time() <= record.started + 1)
    except psutil.Error:  # gone (or a zombie's details unreadable): not running
        return False
