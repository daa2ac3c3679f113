"""dask workers as Slurm jobs (cluster.dask.executor=slurm) on the real 2-node dev cluster.

- workers run on both nodes (asked of each worker: SLURMD_NODENAME), and the dataset they
  build has the content hash a local cluster's has for the same config;
- a worker request no node can hold fails before anything is queued, with a clear message;
- no worker job is left in squeue after the block ends, after an error in it, after workers
  that do not start (with squeue's reason in the error), after Ctrl-C and after a cancel of
  the Prefect flow run (Prefect's SIGTERM to the flow process); the jobs of a flow process
  killed outright are recorded, and their watchdogs (cluster.job_watchdog) cancel them.
"""

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.services import (
    background,
    cancel_flow_run,
    get_json,
    run_deployment,
    service_env,
    wait_for,
)
from trainflow.cluster import registry
from trainflow.cluster.config import DaskConfig
from trainflow.cluster.dask import dask_client
from trainflow.cluster.slurm_checks import read_nodes
from trainflow.errors import ConfigError, JobError
from trainflow.tasks.preprocess.config import PreprocessConfig
from trainflow.tasks.preprocess.run import run_preprocess
from trainflow.tasks.preprocess.sources import fingerprint

REPO = Path(__file__).resolve().parents[2]
_SMALL = {"executor": "slurm", "mem_gb": 0.5, "timeout_min": 10, "start_timeout_s": 180}


def _worker_jobs() -> list[str]:
    """Ids of every dask worker job trainflow has in squeue (their names start alike)."""
    out = subprocess.run(
        ["squeue", "-h", "-o", "%i %j"], capture_output=True, text=True, check=True
    ).stdout
    return [line.split()[0] for line in out.splitlines() if " trainflow-dask-" in line]


def _no_worker_jobs_left() -> None:
    """Wait (a guard, not a timing) for cancelled jobs to pass COMPLETING and leave squeue."""
    wait_for(lambda: _worker_jobs() == [] or None, 60, "the worker jobs to leave squeue")


def _node_of_each_worker(client: object) -> list[str]:
    where = client.run(lambda: os.environ.get("SLURMD_NODENAME", "?"))  # type: ignore[attr-defined]
    return sorted(where.values())


def test_workers_on_two_nodes_build_the_local_clusters_dataset(tmp_path: Path) -> None:
    # More than half a node's CPUs per worker, so Slurm cannot put both on one node (the CPUs
    # are only booked: each worker runs one thread).
    half = max(n.cpus for n in read_nodes()) // 2 + 1
    cfg = DaskConfig(**_SMALL, n_workers=2, cpus_per_worker=half)
    pre = PreprocessConfig(source="synthetic", synthetic_samples=300, shard_size=64)
    with dask_client(cfg, tmp_path / "logs") as (client, backend):
        assert backend == "numpy"
        assert _node_of_each_worker(client) == ["tfnode1", "tfnode2"]
        assert len(_worker_jobs()) == 2
        on_slurm = run_preprocess(pre, tmp_path / "slurm", client, backend, fingerprint(pre))
    _no_worker_jobs_left()
    local = DaskConfig(backend="cpu", n_workers=2)
    with dask_client(local) as (client, backend):
        here = run_preprocess(pre, tmp_path / "local", client, backend, fingerprint(pre))
    assert on_slurm.content_hash == here.content_hash
    assert on_slurm.counts == here.counts


def test_a_worker_no_node_can_hold_fails_before_queueing(tmp_path: Path) -> None:
    most = max(n.cpus for n in read_nodes())
    cfg = DaskConfig(**_SMALL, cpus_per_worker=most + 1)
    fix = f"cluster.dask.cpus_per_worker={most + 1}, but .* offers {most} CPUs"
    with pytest.raises(ConfigError, match=fix), dask_client(cfg, tmp_path):
        pass
    _no_worker_jobs_left()
    # The command line refuses it in preflight, before Prefect or any server starts.
    cli = [sys.executable, "-m", "trainflow.flows.cli", "run", "--preset", "tiny"]
    sets = ["cluster.dask.executor=slurm", "cluster.dask.mem_gb=100000", f"workdir={tmp_path}"]
    out = subprocess.run(
        [*cli, *(a for s in sets for a in ("--set", s))],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
    )
    assert out.returncode != 0
    assert "cluster.dask.mem_gb=100000" in out.stderr and "MiB" in out.stderr, out.stderr
    assert "Traceback" not in out.stderr
    _no_worker_jobs_left()


def test_a_worker_job_sbatch_refuses_fails_with_sbatchs_words(tmp_path: Path) -> None:
    cfg = DaskConfig(**_SMALL, n_workers=1, sbatch_extra={"constraint": "nosuch"})
    refused = "sbatch refused a dask worker job: sbatch: error: .*Invalid feature specification"
    with pytest.raises(JobError, match=refused), dask_client(cfg, tmp_path):
        pass
    _no_worker_jobs_left()


def test_no_worker_job_is_left_after_an_error(tmp_path: Path) -> None:
    cfg = DaskConfig(**_SMALL, n_workers=1)
    with pytest.raises(RuntimeError, match="boom"), dask_client(cfg, tmp_path):
        assert len(_worker_jobs()) == 1
        raise RuntimeError("boom")
    _no_worker_jobs_left()


def test_workers_that_do_not_start_say_why_and_are_cancelled(tmp_path: Path) -> None:
    # A start time an hour away: squeue's reason is BeginTime for as long as we wait.
    cfg = DaskConfig(
        **{**_SMALL, "start_timeout_s": 3}, n_workers=1, sbatch_extra={"begin": "now+1hour"}
    )
    with pytest.raises(JobError) as err, dask_client(cfg, tmp_path):
        pytest.fail("the workers cannot have started")
    message = str(err.value)
    assert "1 of 1 dask worker job(s) did not start" in message
    assert "PENDING, reason BeginTime" in message
    assert "cluster.dask.start_timeout_s=3" in message
    job_id = re.search(r"job (\d+): PENDING", message)
    assert job_id is not None
    _no_worker_jobs_left()


_HOLD = """
import sys, time
from pathlib import Path
from trainflow.cluster import registry
from trainflow.cluster.config import DaskConfig
from trainflow.cluster.dask import dask_client
cfg = DaskConfig(executor="slurm", n_workers=2, mem_gb=0.5, timeout_min=10, start_timeout_s=180)
with dask_client(cfg, Path(sys.argv[1])) as (client, _):
    print("ready", flush=True)
    time.sleep(600)
"""


def test_ctrl_c_cancels_every_worker_job(tmp_path: Path) -> None:
    proc = subprocess.Popen(
        [sys.executable, "-c", _HOLD, str(tmp_path)],
        stdout=subprocess.PIPE,
        text=True,
        cwd=REPO,
    )
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == "ready"
        assert len(_worker_jobs()) == 2
        proc.send_signal(signal.SIGINT)
        # An uncaught KeyboardInterrupt (dask_jobqueue's import would make it a clean exit 0)
        assert proc.wait(timeout=120) == -signal.SIGINT
    finally:
        proc.kill()
    _no_worker_jobs_left()
    assert registry.recorded(tmp_path) == []


def test_the_watchdogs_cancel_the_worker_jobs_of_a_killed_flow_process(tmp_path: Path) -> None:
    proc = subprocess.Popen(
        [sys.executable, "-c", _HOLD, str(tmp_path)], stdout=subprocess.PIPE, text=True, cwd=REPO
    )
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == "ready"
        jobs = sorted(_worker_jobs())
        assert len(jobs) == 2
    finally:
        proc.kill()  # SIGKILL: nothing in the process can cancel its jobs
        proc.wait()
    _no_worker_jobs_left()  # else orphans, until their workers' death timeout
    wait_for(lambda: registry.recorded(tmp_path) == [], 10, "the watchdogs to forget the jobs")


def test_cancelling_the_prefect_flow_run_cancels_the_worker_jobs(
    tmp_path: Path, prefect_api: str
) -> None:
    """A served pipeline whose worker job pends (BeginTime) until the flow run is cancelled."""
    api = prefect_api
    env = service_env(PREFECT_API_URL=api, PREFECT_HOME=str(tmp_path / "prefect-home"))
    serve = "from trainflow.flows.pipeline import pipeline; pipeline.serve(name='dask-cancel')"
    with background([sys.executable, "-c", serve], tmp_path / "serve.log", env, REPO):
        overrides = [
            "cluster.dask.executor=slurm",
            "cluster.dask.n_workers=1",
            "cluster.dask.mem_gb=0.5",
            "cluster.dask.timeout_min=10",
            'cluster.dask.sbatch_extra={"begin": "now+1hour"}',
            f"workdir={tmp_path / 'work'}",
        ]
        parameters = {"preset": "tiny", "overrides": overrides}
        flow_run = run_deployment(api, "trainflow-pipeline/dask-cancel", parameters)
        wait_for(lambda: _worker_jobs() or None, 240, "the flow to queue its worker job")
        cancel_flow_run(api, flow_run)
        _no_worker_jobs_left()

        def cancelled() -> bool | None:
            run = get_json(f"{api}/flow_runs/{flow_run}")
            return (run and run["state"]["type"] == "CANCELLED") or None

        wait_for(cancelled, 60, "the flow run to be Cancelled")
