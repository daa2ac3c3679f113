"""The sbatch templates under deploy/slurm, submitted to the real single-node Slurm.

- pipeline.sbatch runs a whole pipeline inside one allocation and logs to MLflow and Prefect;
  on 2 nodes its dask workers and its training ranks are each one srun step over both;
  its early-warning signal stops the flow cleanly (runs KILLED, no training rank left on
  either node of a 2-node job).
- prefect-worker.sbatch keeps a Prefect worker in a pool and requeues itself on its signal.
- scrontab.example's entry, submitted as the very batch job scrontab would make of it.
"""

import json
import re
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from mlflow.entities import Run
from mlflow.tracking import MlflowClient

from tests.services import post_ok, service_env, wait_for

REPO = Path(__file__).resolve().parents[2]
TEMPLATES = REPO / "deploy" / "slurm"
PLACEHOLDER = "/path/to/trainflow"
ENDED = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "OUT_OF_MEMORY", "NODE_FAIL", "DEADLINE"}
ENDED |= {"PREEMPTED", "BOOT_FAIL"}
# The templates' `trainflow` commands run in the job, cold, as on a cluster's compute node.


# --- Slurm -----------------------------------------------------------------------------------


def _slurm(*argv: str, env: dict[str, str] | None = None) -> str:
    done = subprocess.run(argv, capture_output=True, text=True, env=env)
    assert done.returncode == 0, f"{' '.join(argv)} failed:\n{done.stdout}{done.stderr}"
    return done.stdout


def _in_squeue(job_id: str) -> bool:
    return bool(_slurm("squeue", "-h", "-j", job_id, "-o", "%i").strip())


@contextmanager
def submitted(argv: list[str], env: dict[str, str]) -> Iterator[str]:
    """`sbatch --parsable argv...`: yields the job id; cancels the job if it is still queued."""
    job_id = _slurm("sbatch", "--parsable", *argv, env=env).strip().split(";")[0]
    try:
        yield job_id
    finally:
        if _in_squeue(job_id):
            subprocess.run(["scancel", job_id], check=False)


def _accounting(job_id: str) -> tuple[str, str] | None:
    """(state, exit code) of the job's allocation from sacct, once recorded."""
    lines = _slurm("sacct", "-n", "-X", "-P", "-o", "State,ExitCode", "-j", job_id).split()
    if not lines:
        return None
    state, exit_code = lines[0].split("|")
    return state.split()[0], exit_code  # "CANCELLED by 0" -> "CANCELLED"


def _tail(path: Path) -> str:
    return path.read_text()[-4000:] if path.exists() else f"(no {path})"


def wait_ended(job_id: str, output: Path, limit_s: float = 150) -> tuple[str, str]:
    """The final (state, exit code) of a job; fails with the job's output if it does not end."""

    def ended() -> tuple[str, str] | None:
        got = _accounting(job_id)
        return got if got and got[0] in ENDED and not _in_squeue(job_id) else None

    try:
        return wait_for(ended, limit_s, f"job {job_id} to end")
    except AssertionError as err:
        raise AssertionError(f"{err}; its output:\n{_tail(output)}") from None


def _job_fields(job_id: str) -> dict[str, str]:
    """`scontrol show job -o` as a dict (JobState, Restarts, ...)."""
    line = _slurm("scontrol", "show", "job", "-o", job_id)
    return dict(re.findall(r"(\w+)=(\S*)", line))


def _live_processes_with(arg: str) -> list[int]:
    """Pids of live (not zombie) processes with `arg` among their arguments."""
    pids = []
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            args = (proc / "cmdline").read_bytes().split(b"\0")
            state = (proc / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if arg.encode() in args and state not in ("Z", "X"):
            pids.append(int(proc.name))
    return pids


def _live_pid(pid: str) -> bool:
    """Whether process `pid` is alive (not a zombie)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] not in "ZX"
    except OSError:
        return False


# --- Prefect and MLflow ----------------------------------------------------------------------


def job_env(**extra: str) -> dict[str, str]:
    """What sbatch exports to a job: our environment, without an MLflow server set."""
    env = service_env(**extra)
    env.pop("MLFLOW_TRACKING_URI", None)
    return env


def pipeline_runs(workdir: Path) -> tuple[Run, dict[str, Run]]:
    """The one parent run in the workdir's default store and its children by name."""
    client = MlflowClient(f"sqlite:///{workdir}/mlflow.db")
    exp = client.get_experiment_by_name("trainflow")
    assert exp is not None, f"no MLflow experiment in {workdir}/mlflow.db"
    runs = client.search_runs([exp.experiment_id])
    parents = [r for r in runs if "mlflow.parentRunId" not in r.data.tags]
    assert len(parents) == 1, [r.info.run_name for r in parents]
    parent = parents[0]
    kids = [r for r in runs if r.data.tags.get("mlflow.parentRunId") == parent.info.run_id]
    return parent, {r.info.run_name: r for r in kids}


# --- pipeline.sbatch -------------------------------------------------------------------------


def _completed_pipeline(
    tmp_path: Path,
    prefect_api: str,
    *sbatch_options: str,
    sets: tuple[str, ...] = (),
    env: dict[str, str] | None = None,
) -> tuple[str, Run, dict[str, Run], str]:
    """Submit pipeline.sbatch (preset tiny, plus `sets` overrides) with these sbatch options and
    `env` exported, wait until it completes, and check its parent and stage runs finished;
    returns (job id, parent, stages, job log)."""
    argv = [
        *(f"--chdir={REPO}", f"--output={tmp_path}/%j.out", *sbatch_options),
        *(str(TEMPLATES / "pipeline.sbatch"), "--preset", "tiny"),
        *("--set", f"workdir={tmp_path}/work"),
        *(item for value in sets for item in ("--set", value)),
    ]
    with submitted(argv, job_env(PREFECT_API_URL=prefect_api, **(env or {}))) as job_id:
        out = tmp_path / f"{job_id}.out"
        assert wait_ended(job_id, out) == ("COMPLETED", "0:0"), _tail(out)
    parent, kids = pipeline_runs(tmp_path / "work")
    assert parent.info.status == "FINISHED"
    assert sorted(kids) == ["evaluate", "preprocess", "train"]
    assert all(r.info.status == "FINISHED" for r in kids.values())
    return job_id, parent, kids, out.read_text()


def test_pipeline_template_runs_a_whole_pipeline_in_one_allocation(
    tmp_path: Path, prefect_api: str
) -> None:
    _job_id, parent, _kids, log = _completed_pipeline(tmp_path, prefect_api)
    assert parent.data.metrics["test_accuracy"] > 0.5
    # Training ran inside the allocation, each of the 2 ranks with half of its 4 CPUs.
    assert parent.data.params["cluster.executor"] == "local"
    assert parent.data.params["cluster.cpus_per_task"] == "2"

    assert f"MLflow store    sqlite:///{tmp_path}/work/mlflow.db" in log
    assert "== trainflow summary ==" in log
    assert f"parent run id   {parent.info.run_id}" in log
    # The flow ran against the submitter's Prefect server, not a temporary one in the job.
    # The newest 200 (the server is the whole test run's: a page of all would miss ours).
    flow_runs = post_ok(f"{prefect_api}/flow_runs/filter", {"sort": "START_TIME_DESC"})
    ours = [r for r in flow_runs if str(tmp_path) in json.dumps(r["parameters"])]
    assert [(r["parameters"]["preset"], r["state_type"]) for r in ours] == [("tiny", "COMPLETED")]


def test_pipeline_template_spreads_dask_workers_over_a_two_node_allocation(
    tmp_path: Path, prefect_api: str
) -> None:
    # With the user's own model, found on the exported PYTHONPATH: every rank, on both nodes,
    # builds it from the run's snapshot.
    (tmp_path / "user code").mkdir()
    (tmp_path / "user code" / "sbatch_models.py").write_text(_SBATCH_MODELS)
    job_id, parent, kids, log = _completed_pipeline(
        tmp_path,
        prefect_api,
        *("--nodes=2", "--ntasks=2", "--cpus-per-task=2"),
        sets=("train.model=sbatch_models:build", 'train.model_args={"hidden": 6}'),
        env={"PYTHONPATH": str(tmp_path / "user code")},
    )
    assert kids["train"].data.params["model_parameters"] == str(256 * 6 + 6 + 6 * 4 + 4)
    snapshot = tmp_path / "work" / "runs" / parent.info.run_id / "jobs" / "code" / "0"
    built = set(re.findall(r"\[rank(\d)@(tfnode\d)\] built from (\S+)", log))
    assert {(rank, node) for rank, node, _ in built} == {
        ("0", "tfnode1"), ("1", "tfnode1"), ("2", "tfnode2"), ("3", "tfnode2")
    }, log  # fmt: skip
    assert {file for _, _, file in built} == {str(snapshot / "sbatch_models.py")}
    assert parent.data.params["cluster.dask.executor"] == "allocation"
    assert "nodes 2" in log
    # Asked of each worker: one per node, both inside this job (a step, not a new job).
    assert f"dask workers (Slurm): job {job_id} on tfnode1, job {job_id} on tfnode2" in log, log
    steps = _slurm("sacct", "-n", "-P", "-o", "JobName,NodeList", "-j", job_id).split()
    assert any(s.startswith("trainflow-dask-") and s.endswith("|tfnode[1-2]") for s in steps)
    # Training too: 2 nodes x 2 ranks as one step of this job, each rank's lines naming its node.
    assert parent.data.params["cluster.executor"] == "allocation"
    assert parent.data.params["cluster.nodes"] == "2"
    assert any(s.startswith("trainflow-train-") and s.endswith("|tfnode[1-2]") for s in steps)
    ranks = set(re.findall(r"\[rank(\d)@(tfnode\d)\] ", log))
    assert ranks == {("0", "tfnode1"), ("1", "tfnode1"), ("2", "tfnode2"), ("3", "tfnode2")}, log


_SBATCH_MODELS = """\
from torch import nn


def build(spec, hidden=4):
    print(f"built from {__file__}", flush=True)
    c, h, w = spec.sample_shape
    return nn.Sequential(nn.Flatten(), nn.Linear(c * h * w, hidden), nn.ReLU(),
                         nn.Linear(hidden, spec.num_classes))
"""


def test_pipeline_template_signal_stops_the_flow_and_marks_runs_killed(
    tmp_path: Path, prefect_api: str
) -> None:
    workdir = tmp_path / "work"
    # On 2 nodes: training is an srun step over both (cluster.executor=allocation), 1 rank each.
    argv = [
        *(f"--chdir={REPO}", f"--output={tmp_path}/%j.out", "--nodes=2", "--ntasks=2"),
        *("--cpus-per-task=2", str(TEMPLATES / "pipeline.sbatch")),
        *("--preset", "tiny", "--set", f"workdir={workdir}", "--set", "train.epochs=5000"),
        *("--set", "cluster.ranks_per_node=1"),
    ]
    with submitted(argv, job_env(PREFECT_API_URL=prefect_api)) as job_id:
        out = tmp_path / f"{job_id}.out"
        wait_for(lambda: "epoch 1/5000" in _tail(out), 150, "the first training epoch")
        ranks = [json.loads(p.read_text()) for p in workdir.rglob("*_rank.json")]
        # What --signal=B:TERM@120 makes Slurm send before the time limit.
        _slurm("scancel", "--signal=TERM", "--batch", job_id)
        state = wait_ended(job_id, out)

    assert state[0] == "FAILED", _tail(out)
    # trainflow's status when interrupted, as the controller saw it (sacct may show another).
    assert _job_fields(job_id)["ExitCode"] == "130:0"
    assert "trainflow: interrupted; the training job was cancelled" in out.read_text()
    parent, kids = pipeline_runs(workdir)
    assert parent.info.status == "KILLED"
    assert kids["train"].info.status == "KILLED"
    assert kids["preprocess"].info.status == "FINISHED"
    # The flow cancelled its training step: no rank, nor its guard, is left on either node.
    assert sorted(r["slurm_node"] for r in ranks) == ["tfnode1", "tfnode2"], ranks
    pids = [str(r[key]) for r in ranks for key in ("pid", "guard_pid")]
    wait_for(lambda: not any(_live_pid(pid) for pid in pids), 20, "no rank left on any node")


def test_pipeline_template_refuses_bad_arguments_before_any_work(tmp_path: Path) -> None:
    argv = [
        *(f"--chdir={tmp_path}", f"--output={tmp_path}/%j.out", str(TEMPLATES / "pipeline.sbatch")),
        *("--preset", "tiny", "--set", "train.epochs=0"),
    ]
    with submitted(argv, job_env(TRAINFLOW_ROOT=str(REPO))) as job_id:
        out = tmp_path / f"{job_id}.out"
        assert wait_ended(job_id, out) == ("FAILED", "2:0")
    log = out.read_text()
    assert "train.epochs" in log and "pipeline.sbatch: error: invalid arguments" in log
    assert not (tmp_path / "trainflow-work").exists()


def test_pipeline_template_gives_each_allocated_gpu_a_rank(tmp_path: Path) -> None:
    argv = [
        *(f"--chdir={tmp_path}", f"--output={tmp_path}/%j.out", "--gpus-per-node=2"),
        # 4: each dev node has 4 of the cluster's 8 CPUs.
        *("--cpus-per-task=4", str(TEMPLATES / "pipeline.sbatch"), "--preset", "tiny"),
    ]
    with submitted(argv, job_env(TRAINFLOW_ROOT=str(REPO), TRAINFLOW_DRY_RUN="1")) as job_id:
        out = tmp_path / f"{job_id}.out"
        assert wait_ended(job_id, out) == ("COMPLETED", "0:0"), _tail(out)
    log = out.read_text()
    assert "CPUs 4, GPUs 2, training ranks 2" in log, log
    assert (
        "run --set cluster.executor=local --set cluster.gpus_per_node=2 "
        "--set cluster.ranks_per_node=2 --set cluster.cpus_per_task=2 --preset tiny"
    ) in log, log
    assert not (tmp_path / "trainflow-work").exists()  # a dry run does no work


# --- prefect-worker.sbatch -------------------------------------------------------------------


def test_worker_template_serves_the_pool_and_requeues_itself(
    tmp_path: Path, prefect_api: str
) -> None:
    pool = "trainflow-slurm-test"
    env = job_env(PREFECT_API_URL=prefect_api)
    _slurm(
        str(REPO / ".venv/bin/prefect"), "work-pool", "create", pool, "--type", "process", env=env
    )

    def worker(name: str) -> dict[str, Any] | None:
        rows = post_ok(f"{prefect_api}/work_pools/{pool}/workers/filter", {})
        return next((w for w in rows if w["name"] == name), None)

    argv = [
        *(f"--chdir={tmp_path}", f"--output={tmp_path}/%j.out", "--time=10"),
        str(TEMPLATES / "prefect-worker.sbatch"),
    ]
    extra = {"TRAINFLOW_POOL": pool, "TRAINFLOW_ROOT": str(REPO), "TRAINFLOW_WORKER_DRAIN_S": "30"}
    with submitted(argv, {**env, **extra}) as job_id:
        out = tmp_path / f"{job_id}.out"
        name = f"slurm-{job_id}"
        wait_for(lambda: worker(name), 120, f"worker {name} in pool {pool}")
        # What --signal=B:USR1@300 makes Slurm send before the time limit.
        _slurm("scancel", "--signal=USR1", "--batch", job_id)
        wait_for(lambda: _job_fields(job_id).get("Restarts") == "1", 90, "the requeue")
        # The first attempt's worker has exited: a newer heartbeat comes from the second one.
        before = worker(name)
        assert before is not None
        wait_for(lambda: "attempt 2 on" in _tail(out), 120, "the second attempt")
        wait_for(
            lambda: (
                (w := worker(name)) and w["last_heartbeat_time"] > before["last_heartbeat_time"]
            ),
            120,
            "the requeued worker's heartbeat",
        )
        assert _job_fields(job_id)["JobState"] == "RUNNING"
        _slurm("scancel", job_id)
        wait_for(lambda: not _in_squeue(job_id), 60, f"job {job_id} to leave squeue")
        # No worker outlives its job (without cgroups Slurm tracks processes by parentage).
        assert _live_processes_with(name) == []

    log = out.read_text()
    assert "attempt 1 on" in log and f"requeueing job {job_id}" in log, log[-4000:]
    assert "still busy" not in log  # the SIGINT stopped the idle worker within the drain time
    states = _slurm("sacct", "-n", "-X", "-P", "--duplicates", "-o", "State", "-j", job_id)
    assert "REQUEUED" in states.split(), states


# --- scrontab.example ------------------------------------------------------------------------


def scron_entry(text: str) -> tuple[list[str], str, str]:
    """The #SCRON options, the time spec and the command of a crontab's single entry."""
    options: list[str] = []
    entries = []
    for line in text.splitlines():
        if line.startswith("#SCRON"):
            options += line.split()[1:]
        elif line.strip() and not line.startswith("#"):
            fields = line.split(maxsplit=1 if line.startswith("@") else 5)
            entries.append((" ".join(fields[:-1]), fields[-1]))
    assert len(entries) == 1, entries
    return options, *entries[0]


def test_scrontab_entry_runs_the_pipeline_as_scrontab_would(tmp_path: Path) -> None:
    text = (TEMPLATES / "scrontab.example").read_text().replace(PLACEHOLDER, str(REPO))
    options, spec, command = scron_entry(text)
    assert re.fullmatch(r"(\S+ ){4}\S+", spec), spec
    assert any(o.startswith("--output=") for o in options)
    # Test-sized: a tiny preset, state and log under tmp_path instead of the checkout.
    options = [f"--output={tmp_path}/%j.out" if o.startswith("--output=") else o for o in options]
    assert "--preset demo" in command
    command = command.replace("--preset demo", f"--preset tiny --set workdir={tmp_path}/work")
    # The batch job scrontab makes of an entry: /bin/sh runs the command; no environment of
    # ours but the login one on the node (--export=NONE is sbatch's way to ask for that).
    script = tmp_path / "scron-job.sh"
    lines = ["#!/bin/sh", "# This job was submitted through scrontab"]
    lines += [f"#SCRON {o}" for o in options]
    lines += [f"# crontab time request was: '{spec}'", command]
    script.write_text("\n".join(lines) + "\n")
    with submitted(["--export=NONE", *options, str(script)], job_env()) as job_id:
        out = tmp_path / f"{job_id}.out"
        assert wait_ended(job_id, out) == ("COMPLETED", "0:0"), _tail(out)
    parent, kids = pipeline_runs(tmp_path / "work")
    assert parent.info.status == "FINISHED"
    assert sorted(kids) == ["evaluate", "preprocess", "train"]
    assert "== trainflow summary ==" in out.read_text()
