"""The Prefect deployments on the local stack, end to end.

The file brings up one real stack with deploy/stack.sh (a Prefect server on SQLite, a
process worker, an MLflow server) on free loopback ports with its state, stores and pool
under a temporary folder, registers deploy/prefect.yaml with `stack.sh deploy`, starts runs
with `prefect deployment run` and stops everything with `stack.sh down`. Its tests share the
stack (one start and one `deploy` instead of one per test, ~25 and ~12 CPU seconds) and
each logs to an MLflow experiment of its own; the last one checks `down`.
"""

import json
import re
import signal
import subprocess
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil
import pytest
from mlflow.entities import Run
from mlflow.tracking import MlflowClient

from tests.services import (
    cancel_flow_run,
    free_port,
    get_json,
    run_deployment,
    service_env,
    wait_for,
)
from trainflow.cluster import registry

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
PREFECT = str(REPO / ".venv" / "bin" / "prefect")
_FINAL = {"COMPLETED", "FAILED", "CRASHED", "CANCELLED"}


@dataclass
class Stack:
    """One local stack started by deploy/stack.sh, and how to reach it."""

    dir: Path
    env: dict[str, str]
    api: str
    mlflow: str
    deployed: str = ""
    """What `stack.sh deploy` printed (the fixture deploys once for the file's tests)."""

    def sh(self, action: str, timeout: float = 300) -> str:
        """Run `deploy/stack.sh <action>`; its output (it must succeed)."""
        out = subprocess.run(
            [str(REPO / "deploy" / "stack.sh"), action],
            capture_output=True, text=True, env=self.env, timeout=timeout, cwd=REPO,
        )  # fmt: skip
        assert out.returncode == 0, f"stack.sh {action} failed:\n{out.stdout}\n{out.stderr}"
        return out.stdout

    def prefect(self, *args: str) -> str:
        """Run the Prefect CLI against this stack's server; its output (it must succeed)."""
        out = subprocess.run(
            [PREFECT, *args], capture_output=True, text=True, env=self.env, timeout=120
        )
        assert out.returncode == 0, f"prefect {args} failed:\n{out.stdout}\n{out.stderr}"
        return out.stdout

    def run_deployment(self, name: str, overrides: dict[str, Any]) -> str:
        """Start a run of trainflow-pipeline/<name> on preset tiny; its flow run id."""
        out = self.prefect(
            *("deployment", "run", f"trainflow-pipeline/{name}", "--param", "preset=tiny"),
            *("--param", f"overrides={json.dumps(overrides)}"),
        )
        found = re.search(r"UUID:\s*([0-9a-f-]{36})", out)
        assert found, out
        return found.group(1)

    def state(self, flow_run: str) -> str | None:
        """The flow run's state type (COMPLETED, CANCELLED, ...)."""
        run = get_json(f"{self.api}/flow_runs/{flow_run}")
        return str(run["state"]["type"]) if run and run.get("state") else None

    def final_state(self, flow_run: str, limit_s: float) -> str:
        """Wait for the flow run to end; its final state type."""

        def ended() -> str | None:
            state = self.state(flow_run)
            return state if state in _FINAL else None

        try:
            return wait_for(ended, limit_s, "the flow run to end")
        except AssertionError as err:
            raise AssertionError(f"{err}; worker log:\n{self.log('worker')}") from None

    def log(self, service: str) -> str:
        """The end of a service's log (for failure messages)."""
        path = self.dir / f"{service}.log"
        return path.read_text()[-4000:] if path.exists() else "(no log)"

    def processes(self) -> list[psutil.Process]:
        """Live processes started by this stack (they carry its id in their environment)."""
        mark = f"TRAINFLOW_STACK_ID={self.dir}"
        found = []
        for proc in psutil.process_iter():
            try:
                env = Path(f"/proc/{proc.pid}/environ").read_bytes().split(b"\0")
                if mark.encode() in env and proc.status() != psutil.STATUS_ZOMBIE:
                    found.append(proc)
            except (OSError, psutil.Error):
                continue
        return found


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    """A local stack up, with its own ports, pool, stores and state."""
    tmp_path = tmp_path_factory.mktemp("stack")
    prefect_port, mlflow_port = free_port(), free_port()
    state = tmp_path / "stack"
    state.mkdir()
    api = f"http://127.0.0.1:{prefect_port}/api"
    env = service_env(
        TRAINFLOW_STACK_DIR=str(state),
        PREFECT_PORT=str(prefect_port),
        MLFLOW_PORT=str(mlflow_port),
        TRAINFLOW_POOL=f"test-{uuid.uuid4().hex[:8]}",
        TRAINFLOW_MLFLOW_STORE=f"sqlite:///{tmp_path}/mlflow/mlflow.db",
        TRAINFLOW_MLFLOW_ARTIFACTS=str(tmp_path / "mlflow" / "artifacts"),
        # The harness of tests/integration points this process elsewhere: name ours.
        PREFECT_API_URL=api,
        PREFECT_HOME=str(state / "prefect-home"),
        PREFECT_WORKER_QUERY_SECONDS="2",  # the worker picks up runs sooner
        PYTHONPATH=str(tmp_path / "user code"),  # where the worker finds a user's model plug-in
    )
    env.pop("MLFLOW_TRACKING_URI", None)
    stack = Stack(state, env, api, f"http://127.0.0.1:{mlflow_port}")
    try:
        stack.sh("up")
        stack.deployed = stack.sh("deploy")  # ~6 CPU s a deployment: once for both tests
        yield stack
    finally:
        subprocess.run([str(REPO / "deploy" / "stack.sh"), "down"], env=env, timeout=300)
        for proc in stack.processes():  # only if down failed: never leave processes behind
            proc.send_signal(signal.SIGKILL)


def _mlflow_runs(url: str, experiment: str) -> list[Run]:
    client = MlflowClient(url)
    exp = client.get_experiment_by_name(experiment)
    assert exp is not None, f"the run logged no experiment {experiment!r} to the stack's MLflow"
    return list(client.search_runs([exp.experiment_id]))


def _processes_mentioning(folder: Path) -> list[psutil.Process]:
    """Live processes with `folder` in their command line (the training job's ranks)."""
    found = []
    for proc in psutil.process_iter(["cmdline", "status"]):
        cmdline = proc.info["cmdline"] or []
        if proc.info["status"] != psutil.STATUS_ZOMBIE and any(str(folder) in a for a in cmdline):
            found.append(proc)
    return found


_DEPLOY_MODELS = """\
from torch import nn


def build(spec, hidden=4):
    c, h, w = spec.sample_shape
    return nn.Sequential(nn.Flatten(), nn.Linear(c * h * w, hidden), nn.ReLU(),
                         nn.Linear(hidden, spec.num_classes))
"""


def _training(work: Path) -> registry.ActiveJob | None:
    """The recorded training job once its rank 0 has finished an epoch."""
    jobs = registry.recorded(work)
    if not jobs:
        return None
    log = Path(jobs[0].folder) / f"{jobs[0].job_id}_0_log.out"
    return jobs[0] if log.exists() and "epoch 2/" in log.read_text() else None


def test_cancelling_a_deployment_run_stops_training_and_kills_its_runs(
    stack: Stack, tmp_path: Path
) -> None:
    work = tmp_path / "work"
    # The preset and the long training come from an experiment file (tiny alone trains 2
    # epochs: done before the cancel), the workdir from an override.
    experiment = tmp_path / "long.toml"
    experiment.write_text(
        'preset = "tiny"\n[train]\nepochs = 5000\n[tracking]\nexperiment = "cancel"\n'
    )
    # Started and cancelled through the API, as the UI's Run and Cancel buttons do (the other
    # test runs the CLI's `prefect deployment run`; each Prefect CLI call costs ~3 CPU s).
    parameters = {"experiment": str(experiment), "overrides": {"workdir": str(work)}}
    flow_run = run_deployment(stack.api, "trainflow-pipeline/adhoc", parameters)
    job = wait_for(lambda: _training(work), 240, "the training job to train an epoch")
    assert job.executor == "local"
    controller = psutil.Process(int(job.job_id))  # a local job's id is its controller's pid
    assert "submitit" in " ".join(controller.cmdline())
    assert len(_processes_mentioning(work)) >= 3  # controller and two ranks

    cancel_flow_run(stack.api, flow_run)
    assert stack.final_state(flow_run, 120) == "CANCELLED"
    wait_for(lambda: not _processes_mentioning(work), 60, "the training processes to exit")
    assert not controller.is_running() or controller.status() == psutil.STATUS_ZOMBIE
    assert registry.recorded(work) == []

    def killed() -> dict[str, str] | None:
        found = {r.info.run_name: r.info.status for r in _mlflow_runs(stack.mlflow, "cancel")}
        return found if found.get("train") == "KILLED" else None

    statuses = wait_for(killed, 30, "MLflow to show the train run KILLED")
    assert statuses == {"tiny": "KILLED", "preprocess": "FINISHED", "train": "KILLED"}


def test_a_search_deployment_run_trains_its_trials_and_evaluates_the_best(
    stack: Stack, tmp_path: Path
) -> None:
    """trainflow-search/adhoc (flows/search.py:search) with a space, run as the UI's Run
    button does, through the stack's worker; trainflow-sweep/adhoc is registered beside it."""
    assert "deployed trainflow-search/adhoc" in stack.deployed
    sweep = get_json(f"{stack.api}/deployments/name/trainflow-sweep/adhoc")
    assert sweep["entrypoint"] == "flows/sweep.py:sweep"
    assert sweep["parameters"] == {"preset": None, "experiment": None, "overrides": {}, "grid": {}}
    work = tmp_path / "work"
    overrides = {"workdir": str(work), "tracking.experiment": "search", "cluster.ranks_per_node": 1}
    parameters = {
        "preset": "tiny",
        "overrides": overrides,
        "space": {"train.lr": "choice(0.005,0.003)"},
        **{"trials": 2, "parallel": 1, "pruner": "none", "study": "deployed"},
    }
    flow_run = run_deployment(stack.api, "trainflow-search/adhoc", parameters)
    assert stack.final_state(flow_run, 300) == "COMPLETED", stack.log("worker")

    runs = _mlflow_runs(stack.mlflow, "search")
    [parent] = [r for r in runs if "mlflow.parentRunId" not in r.data.tags]
    assert parent.info.status == "FINISHED" and parent.data.params["search.study"] == "deployed"
    assert (
        parent.data.params["search.trials"] == "2" and parent.data.params["search.pruner"] == "none"
    )
    children = {r.info.run_name: r.info.status for r in runs if r.info.run_id != parent.info.run_id}
    assert children == {
        name: "FINISHED" for name in ("preprocess", "trial[0]", "trial[1]", "evaluate")
    }
    assert parent.data.tags["best_trial"] in ("0", "1")
    assert 0.0 <= parent.data.metrics["test_accuracy"] <= 1.0
    assert (work / "optuna.db").is_file()  # the study, in the run's workdir


def test_deployment_run_completes_and_logs_to_the_stack_mlflow(
    stack: Stack, tmp_path: Path
) -> None:
    """Last in the file: it ends with `stack.sh down`."""
    pids = {p.pid for p in stack.processes()}
    again = stack.sh("up")  # idempotent: nothing new starts
    assert again.count("already running") == 3 and {p.pid for p in stack.processes()} == pids
    assert "deployed trainflow-pipeline/nightly" in stack.deployed

    work = tmp_path / "work"
    user_code = Path(stack.env["PYTHONPATH"])  # the worker's path: the stack's "user code"
    user_code.mkdir(exist_ok=True)
    (user_code / "deploy_models.py").write_text(_DEPLOY_MODELS)
    model = {"train.model": "deploy_models:build", "train.model_args": {"hidden": 6}}
    overrides = {"workdir": str(work), "tracking.experiment": "completes", **model}
    flow_run = stack.run_deployment("adhoc", overrides)
    assert stack.final_state(flow_run, 300) == "COMPLETED", stack.log("worker")

    runs = _mlflow_runs(stack.mlflow, "completes")
    parents = [r for r in runs if "mlflow.parentRunId" not in r.data.tags]
    assert len(parents) == 1 and parents[0].info.status == "FINISHED"
    parent = parents[0]
    assert 0.0 <= parent.data.metrics["test_accuracy"] <= 1.0
    assert (work / "runs" / parent.info.run_id).is_dir()  # this flow run's own tree
    children = {
        r.info.run_name: r
        for r in runs
        if r.data.tags.get("mlflow.parentRunId") == parent.info.run_id
    }
    statuses = {name: r.info.status for name, r in children.items()}
    assert statuses == {"preprocess": "FINISHED", "train": "FINISHED", "evaluate": "FINISHED"}
    # The user's model, found on the worker's PYTHONPATH, trained from the run's snapshot.
    params = children["train"].data.params
    assert params["model_factory"] == "deploy_models:build" and params["model_args.hidden"] == "6"
    assert params["model_parameters"] == str(256 * 6 + 6 + 6 * 4 + 4)
    assert (
        children["train"].data.tags["code_snapshot_hash"] == parent.data.tags["code_snapshot_hash"]
    )
    server = MlflowClient(stack.mlflow)
    plots = [f.path for f in server.list_artifacts(children["evaluate"].info.run_id)]
    assert "confusion_matrix.png" in plots  # what the UI shows
    # `trainflow run` without a server URI writes the store itself: it must be able to log
    # artifacts to the experiment the deployment run created (a proxied mlflow-artifacts:
    # location would refuse a SQLite client).
    local = MlflowClient(stack.env["TRAINFLOW_MLFLOW_STORE"])
    run_id = local.create_run(parent.info.experiment_id, run_name="local").info.run_id
    local.log_text(run_id, "written without the server", "note.txt")
    assert [f.path for f in server.list_artifacts(run_id)] == ["note.txt"]

    nightly = get_json(f"{stack.api}/deployments/name/trainflow-pipeline/nightly")
    [schedule] = nightly["schedules"]
    assert schedule["schedule"]["cron"] == "0 2 * * *"
    assert schedule["schedule"]["timezone"] == "UTC" and schedule["active"]
    assert nightly["work_pool_name"] == stack.env["TRAINFLOW_POOL"]
    # The worker runs flows from the repository root (the pull step prefect deploy recorded).
    [pull] = nightly["pull_steps"]
    assert pull["prefect.deployments.steps.set_working_directory"]["directory"] == str(REPO)

    assert stack.processes()  # so that the check below can fail
    stack.sh("down")
    assert stack.processes() == []
    assert "stopped" in stack.sh("status")
