"""Runs inside a 2-node sbatch job for test_allocation_executor.py: trains with
cluster.executor=allocation (each training an srun step of that job) and writes what happened
to <out>/results.json for the test to check from outside.

- restart: 1 node x 2 ranks; rank 1 is SIGKILLed after epoch 2; the restart (a new step)
  excludes the lost node and completes on the other one.
- ctrl_c: 2 nodes x 1 rank; a KeyboardInterrupt in the watcher (what Ctrl-C or SIGTERM of the
  flow raises) after epoch 2: wait_for_job cancels the step.
- cleanup: the same, cancelled through the registry as `trainflow cleanup` does.
- refused: a step srun refuses (too many CPUs) fails with srun's own message.

Usage: python -m tests.slurm.allocation_driver <out folder>
"""

import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

from tests.gates import GatedJob
from tests.unit.datasets import write_dataset
from trainflow.cluster import registry
from trainflow.cluster.config import ClusterConfig
from trainflow.cluster.executor import make_executor
from trainflow.cluster.jobs import wait_for_job
from trainflow.cluster.srun_executor import STEP_PREFIX, AllocationJob, step_ids
from trainflow.errors import JobError
from trainflow.tasks.preprocess.ref import DatasetRef
from trainflow.tasks.train import task as train_task
from trainflow.tasks.train.config import TrainConfig
from trainflow.tasks.train.job import TrainingJob, TrainJobSpec
from trainflow.tasks.train.task import train_with_restarts


def _spec(dataset: DatasetRef, out: Path, epochs: int) -> TrainJobSpec:
    train = TrainConfig(epochs=epochs, batch_size=16, device="cpu", precision="fp32", seed=7)
    return TrainJobSpec(train=train, dataset=dataset, out_dir=out, tracking_uri=None, run_id=None)


def _records(folder: Path, job_id: str = "*") -> list[dict[str, Any]]:
    """The rank guards' start records (node, pids) in `folder`, each with its job id."""
    paths = sorted(folder.glob(f"{job_id}_*_rank.json"))
    return [json.loads(p.read_text()) | {"job": p.name.split("_")[0]} for p in paths]


def _steps_left(job_id: str) -> list[str]:
    """Steps of the training job still in squeue after a short grace."""
    slurm_job = os.environ["SLURM_JOB_ID"]
    for _ in range(40):
        left = step_ids(slurm_job, STEP_PREFIX + job_id)
        if not left:
            return []
        time.sleep(0.5)
    return left


def restart(dataset: DatasetRef, out: Path) -> dict[str, Any]:
    """Lose rank 1 mid-training; the restart runs as a new step away from its node. The ranks
    wait before epoch 3 until the kill is done (a gate), so rank 1 is alive to be killed however
    late its epoch-2 line reaches the watcher."""
    cfg = ClusterConfig(executor="allocation", nodes=1, ranks_per_node=2, timeout_min=10)
    job_dir = out / "restart-jobs"
    lines: list[str] = []
    killed: dict[str, Any] = {}
    gate = out / "restart-gate"
    real_job = train_task.TrainingJob
    setattr(train_task, "TrainingJob", lambda spec: GatedJob(spec, {3: gate}))  # noqa: B010

    def kill_rank1_after_epoch_2(line: str) -> None:
        lines.append(line)
        if not killed and "epoch 2/6" in line:
            (record,) = [r for r in _records(job_dir) if r["task"] == 1]
            os.kill(int(record["pid"]), signal.SIGKILL)
            killed.update(record)
            gate.touch()

    warnings: list[str] = []
    spec = _spec(dataset, out / "restart-run", epochs=6)
    try:
        ref = train_with_restarts(
            spec, cfg, job_dir, out, kill_rank1_after_epoch_2, warnings.append
        )
    finally:
        setattr(train_task, "TrainingJob", real_job)  # noqa: B010
    return {
        "lines": lines,
        "warnings": warnings,
        "killed": killed,
        "checkpoint": str(ref.path),
        "records": _records(job_dir),
    }


def cancelled(dataset: DatasetRef, out: Path, how: str) -> dict[str, Any]:
    """Cancel a 2-node step after epoch 2, by Ctrl-C in the watcher or through the registry."""
    cfg = ClusterConfig(executor="allocation", nodes=2, ranks_per_node=1, timeout_min=10)
    folder = out / f"{how}-jobs"
    job = make_executor(cfg, folder).submit(TrainingJob(_spec(dataset, out / how, epochs=5000)))
    assert isinstance(job, AllocationJob)
    seen: list[str] = []

    def cancel_after_epoch_2(line: str) -> None:
        if not seen and "epoch 2/" in line:
            seen.append(line)
            if how == "ctrl_c":
                raise KeyboardInterrupt
            record = registry.record(out, job.job_id, "allocation", folder)
            registry.cancel(record)

    error = ""
    try:
        wait_for_job(job, cancel_after_epoch_2)
    except KeyboardInterrupt:
        error = "KeyboardInterrupt"
    except JobError as err:
        error = f"{type(err).__name__}: {err}"
    return {
        "job_id": job.job_id,
        "seen": seen,
        "error": error,
        "srun_ended": job.done(),
        "records": _records(folder, job.job_id),
        "steps_left": _steps_left(job.job_id),
    }


def refused(dataset: DatasetRef, out: Path) -> str:
    """The error of a step srun refuses (more CPUs per node than the job has; the preflight
    check is skipped here on purpose)."""
    cfg = ClusterConfig(executor="allocation", nodes=2, ranks_per_node=2, cpus_per_task=2)
    job = make_executor(cfg, out / "refused-jobs").submit(
        TrainingJob(_spec(dataset, out / "refused", 1))
    )
    try:
        wait_for_job(job, lambda line: None)
    except JobError as err:
        return str(err)
    return "(no error)"


def main(out: Path) -> None:
    """Run the cases and write their findings to out/results.json."""
    dataset = write_dataset(out / "ds")
    results = {
        "restart": restart(dataset, out),
        "ctrl_c": cancelled(dataset, out, "ctrl_c"),
        "cleanup": cancelled(dataset, out, "cleanup"),
        "refused": refused(dataset, out),
    }
    (out / "results.json").write_text(json.dumps(results))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
