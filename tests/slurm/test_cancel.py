"""Cancelling a pipeline never leaves its Slurm job, or a rank on any node, running.

Three ways a run ends early, each against the real cluster with a job over both nodes: Ctrl-C
on `trainflow run`, a cancel of the Prefect flow run from the API (what the UI's Cancel
button does), and a flow process killed outright (SIGKILL), whose job its watchdog
(cluster.job_watchdog) cancels. `trainflow cleanup`, for a watchdog lost too, is tested with
local jobs (tests/unit/test_registry.py).
"""

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

from mlflow.tracking import MlflowClient

from tests.services import (
    background,
    cancel_flow_run,
    get_json,
    in_squeue,
    run_deployment,
    service_env,
    wait_for,
)
from trainflow.cluster import registry

_LONG = [
    *("--preset", "tiny", "--set", "cluster.executor=slurm", "--set", "train.epochs=5000"),
    *("--set", "cluster.nodes=2", "--set", "cluster.ranks_per_node=1"),
]


def _running_job(workdir: Path) -> str:
    """The recorded Slurm job id once its rank 0 has trained an epoch."""

    def ready() -> str | None:
        jobs = registry.recorded(workdir)
        if not jobs:
            return None
        logs = list(Path(jobs[0].folder).glob(f"{jobs[0].job_id}_0_log.out"))
        return jobs[0].job_id if logs and "epoch 2/" in logs[0].read_text() else None

    return str(wait_for(ready, 240, "the Slurm job to train"))


def _rank_pids(workdir: Path, job_id: str) -> dict[str, int]:
    """{node: pid} of the job's ranks, from cluster.rank_guard's records."""
    folder = Path(registry.recorded(workdir)[0].folder)
    records = [json.loads(p.read_text()) for p in folder.glob(f"{job_id}_*_rank.json")]
    return {str(r["slurm_node"]): int(r["pid"]) for r in records}


def _alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] not in ("Z", "X")


def _no_rank_left(ranks: dict[str, int]) -> bool:
    return not any(_alive(pid) for pid in ranks.values())


def _statuses(workdir: Path) -> dict[str, str]:
    client = MlflowClient(f"sqlite:///{workdir}/mlflow.db")
    exp = client.get_experiment_by_name("trainflow")
    assert exp is not None
    return {r.info.run_name: r.info.status for r in client.search_runs([exp.experiment_id])}


def _flow_report(err: AssertionError, pid: int, log: Path) -> str:
    """`err`, the flow process's state (where the kernel has it waiting) and the log's tail."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        wchan = Path(f"/proc/{pid}/wchan").read_text()
    except OSError:
        stat, wchan = "gone", ""
    return f"{err}\nflow process {pid}: state {stat} {wchan}\n{log.read_text()[-4000:]}"


def _ended(statuses: dict[str, str]) -> dict[str, str] | None:
    """`statuses` once the train run and its parent have ended (a run is marked at a time)."""
    ended = "train" in statuses and "RUNNING" not in statuses.values()
    return statuses if ended else None


def _long_run(workdir: Path, new_session: bool = False) -> subprocess.Popen[bytes]:
    """`trainflow run` of a long Slurm training in the background."""
    return subprocess.Popen(
        [sys.executable, "-m", "trainflow.flows.cli", "run", *_LONG, "--set", f"workdir={workdir}"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env=service_env(),
        start_new_session=new_session,
    )


def test_ctrl_c_on_trainflow_run_cancels_the_slurm_job(tmp_path: Path) -> None:
    proc = _long_run(tmp_path)
    try:
        job_id = _running_job(tmp_path)
        assert in_squeue(job_id)
        ranks = _rank_pids(tmp_path, job_id)
        assert sorted(ranks) == ["tfnode1", "tfnode2"]
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=60) == 130
    finally:
        proc.kill()
    wait_for(lambda: not in_squeue(job_id), 20, f"job {job_id} to leave squeue")
    wait_for(lambda: _no_rank_left(ranks), 20, f"no rank of job {job_id} left on any node")
    assert _statuses(tmp_path) == {"tiny": "KILLED", "preprocess": "FINISHED", "train": "KILLED"}
    assert registry.recorded(tmp_path) == []


def test_a_killed_flow_process_s_job_is_cancelled_by_its_watchdog(tmp_path: Path) -> None:
    proc = _long_run(tmp_path, new_session=True)
    try:
        job_id = _running_job(tmp_path)
        (record,) = registry.recorded(tmp_path)
        ranks = _rank_pids(tmp_path, job_id)  # now: the watchdog forgets the record at once
    finally:
        os.killpg(proc.pid, signal.SIGKILL)  # nothing in the flow process can react
        proc.wait()
    assert ranks, "no rank records: the check below could not fail"
    log = Path(record.folder) / f"{job_id}_watchdog.log"
    said = f"the flow process {proc.pid} that watched slurm job {job_id} ended"
    wait_for(lambda: log.exists() and said in log.read_text(), 20, "the watchdog's cancel")
    wait_for(lambda: not in_squeue(job_id), 20, f"job {job_id} to leave squeue")
    wait_for(lambda: _no_rank_left(ranks), 20, f"no rank of job {job_id} left on any node")
    assert registry.recorded(tmp_path) == []
    # Then it ends the runs the flow left RUNNING, as the flow's own cleanup would have.
    statuses = wait_for(
        lambda: _ended(_statuses(tmp_path)),
        60,
        f"MLflow to show the runs KILLED (watchdog log: {log})",
    )
    assert statuses == {"tiny": "KILLED", "preprocess": "FINISHED", "train": "KILLED"}


def test_cancelling_the_prefect_flow_run_cancels_the_slurm_job(
    tmp_path: Path, prefect_api: str
) -> None:
    env = service_env(PREFECT_API_URL=prefect_api, PREFECT_HOME=str(tmp_path / "prefect-home"))
    serve = [
        sys.executable,
        "-c",
        "from trainflow.flows.pipeline import pipeline; pipeline.serve(name='cancel-test')",
    ]
    with background(serve, tmp_path / "serve.log", env):
        overrides = [
            *("cluster.executor=slurm", "train.epochs=5000", f"workdir={tmp_path / 'work'}"),
            *("cluster.nodes=2", "cluster.ranks_per_node=1"),
        ]
        parameters = {"preset": "tiny", "overrides": overrides}
        flow_run = run_deployment(prefect_api, "trainflow-pipeline/cancel-test", parameters)
        job_id = _running_job(tmp_path / "work")
        ranks = _rank_pids(tmp_path / "work", job_id)
        assert sorted(ranks) == ["tfnode1", "tfnode2"]
        (record,) = registry.recorded(tmp_path / "work")
        cancel_flow_run(prefect_api, flow_run)
        try:
            # The runner SIGTERMs the flow process, which cancels the job in about a second; one
            # that does not end in 30 s it SIGKILLs, and the job's watchdog cancels the job.
            wait_for(lambda: not in_squeue(job_id), 60, f"job {job_id} to leave squeue")
        except AssertionError as err:
            report = _flow_report(err, record.owner_pid, tmp_path / "serve.log")
            raise AssertionError(report) from None
        wait_for(lambda: _no_rank_left(ranks), 20, f"no rank of job {job_id} left on any node")

        def state() -> str | None:
            run = get_json(f"{prefect_api}/flow_runs/{flow_run}")
            return run["state"]["type"] if run and run["state"]["type"] == "CANCELLED" else None

        wait_for(state, 60, "the flow run to be Cancelled")
        statuses = wait_for(
            lambda: _ended(_statuses(tmp_path / "work")),
            30,
            "MLflow to show the runs KILLED",
        )
        assert statuses == {"tiny": "KILLED", "preprocess": "FINISHED", "train": "KILLED"}
