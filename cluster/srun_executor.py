"""Training ranks as one `srun` step of the Slurm job the flow runs in (executor=allocation).

For a pipeline that runs inside one multi-node allocation (deploy/slurm/pipeline.sbatch with
--nodes > 1): `cluster.nodes` x `cluster.ranks_per_node` ranks start as one
`srun --overlap` step over the allocation's nodes; no job is queued. Each rank runs under
cluster.rank_guard like under the other executors, and writes submitit's usual files
(``<job id>_<task>_log.out/.err``, ``_result.pkl``, the guard's ``_rank.json`` /
``_exit.json``) in the job folder, so log forwarding, failure messages, lost-rank detection and
restarts work unchanged.

The job id is ``<Slurm job id>-<8 hex>``, new for every step: all steps of an allocation share
its SLURM_JOB_ID, and the id keys submitit's pickles and the rendezvous file, so two trainings
in one allocation (a restart, a second stage) never read each other's files. The step is named
``trainflow-train-<job id>``: cancel() and `trainflow cleanup` find it by that name.

Inside the step each task maps its Slurm step variables onto submitit's local job environment
(SUBMITIT_LOCAL_*; SLURM_NODEID and SLURM_STEP_NUM_NODES are the step's, so a step that
excludes a node still counts right). Rank 0 publishes its own host name for the rendezvous
(tasks.train.rendezvous), which is where it runs.
"""

import os
import shlex
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

from submitit.core import core, utils

from trainflow.cluster.config import ClusterConfig
from trainflow.cluster.node_events import expand_nodes
from trainflow.compat import SubmititCommandHooks
from trainflow.errors import ConfigError

STEP_PREFIX = "trainflow-train-"
CANCEL_WAIT_S = 30
"""How long cancel() waits for srun to end after the step was cancelled before killing it."""

# Each task: submitit's local job variables from the step's Slurm ones, then the rank command.
_TASK_ENV = (
    "export SUBMITIT_EXECUTOR=local SUBMITIT_LOCAL_NTASKS=$SLURM_STEP_NUM_TASKS "
    "SUBMITIT_LOCAL_JOB_NUM_NODES=$SLURM_STEP_NUM_NODES SUBMITIT_LOCAL_NODEID=$SLURM_NODEID "
    'SUBMITIT_LOCAL_GLOBALID=$SLURM_PROCID SUBMITIT_LOCAL_LOCALID=$SLURM_LOCALID; exec "$@"'
)


def allocation_job_id() -> str:
    """The Slurm job this process runs in; ConfigError (what is wrong, the fix) outside one."""
    job_id = os.environ.get("SLURM_JOB_ID")
    if not job_id:
        raise ConfigError(
            "cluster.executor=allocation runs the training ranks inside this process's Slurm "
            "job, but it runs in none (no SLURM_JOB_ID): run it in an sbatch/salloc job "
            "(deploy/slurm/pipeline.sbatch), or set cluster.executor=slurm or local"
        )
    return job_id


def check_allocation(cfg: ClusterConfig) -> None:
    """ConfigError, before any work, when cfg cannot run as a step of this process's job."""
    allocation_job_id()
    have = int(os.environ.get("SLURM_JOB_NUM_NODES", "1"))
    if cfg.nodes > have:
        raise ConfigError(
            f"cluster.nodes={cfg.nodes}, but this Slurm job has {have} node(s): set "
            f"cluster.nodes<={have}, or submit the job with --nodes={cfg.nodes}"
        )
    cpus = cpus_per_node(os.environ.get("SLURM_JOB_CPUS_PER_NODE", ""))
    need = cfg.ranks_per_node * cfg.cpus_per_task
    if cpus is not None and need > cpus:
        raise ConfigError(
            f"cluster.ranks_per_node={cfg.ranks_per_node} x cluster.cpus_per_task="
            f"{cfg.cpus_per_task} = {need} CPUs per node, but this Slurm job has {cpus} on its "
            f"smallest node: lower them, or submit the job with {need} CPUs per node (e.g. "
            f"one task per node and --cpus-per-task={need})"
        )
    gpus = int(os.environ.get("SLURM_GPUS_ON_NODE") or 0)
    if cfg.gpus_per_node > gpus:
        raise ConfigError(
            f"cluster.gpus_per_node={cfg.gpus_per_node}, but this Slurm job has {gpus} GPU(s) "
            f"per node: set cluster.gpus_per_node<={gpus} (0 for CPU), or submit the job with "
            f"--gpus-per-node={cfg.gpus_per_node}"
        )


def cpus_per_node(value: str) -> int | None:
    """The smallest CPU count in a SLURM_JOB_CPUS_PER_NODE value ("4(x2),2"); None if empty."""
    counts = [int(part.split("(")[0]) for part in value.split(",") if part.split("(")[0].isdigit()]
    return min(counts) if counts else None


def allocation_nodes() -> list[str]:
    """The node names of this process's Slurm job (SLURM_JOB_NODELIST expanded)."""
    return expand_nodes(os.environ.get("SLURM_JOB_NODELIST", ""))


def step_ids(slurm_job: str, name: str) -> list[str]:
    """The ids (``<job>.<step>``) of the steps of `slurm_job` called `name`."""
    out = subprocess.run(
        ["squeue", "-h", "-s", "-j", slurm_job, "-o", "%i %j"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    return [line.split()[0] for line in out.stdout.splitlines() if line.endswith(f" {name}")]


def cancel_step(job_id: str) -> list[str]:
    """scancel the step of training job `job_id` (``<Slurm job>-<hex>``); the ids cancelled."""
    steps = step_ids(job_id.split("-", 1)[0], STEP_PREFIX + job_id)
    if steps:
        subprocess.run(["scancel", *steps], capture_output=True, check=False, timeout=30)
    return steps


def step_state(job_id: str, wait_s: float = 10.0) -> str:
    """The ended step's state from sacct (e.g. CANCELLED, FAILED, COMPLETED), waiting up to
    `wait_s` for the accounting record; "UNKNOWN" without one."""
    slurm_job, name = job_id.split("-", 1)[0], STEP_PREFIX + job_id
    deadline = time.monotonic() + wait_s
    while True:
        out = subprocess.run(
            ["sacct", "-n", "-P", "-j", slurm_job, "-o", "JobName,State"],
            capture_output=True,
            text=True,
            timeout=30,
        )
        states = [line.split("|")[1] for line in out.stdout.splitlines() if line.startswith(name)]
        if (states and states[-1] not in ("RUNNING", "PENDING")) or time.monotonic() > deadline:
            return states[-1] if states else "UNKNOWN"
        time.sleep(0.5)


class AllocationJob(core.Job[core.R]):
    """A training step, watched through its srun process (as LocalJob watches its controller)."""

    def __init__(
        self,
        folder: Path | str,
        job_id: str,
        tasks: Any = (0,),
        process: "subprocess.Popen[bytes] | None" = None,
    ) -> None:
        super().__init__(folder, job_id, tasks)
        self.srun = process
        for sub in self._sub_jobs:
            if isinstance(sub, AllocationJob):  # submitit makes the sub-jobs of our class
                sub.srun = process

    def results(self) -> list[core.R]:
        """submitit's results; when srun ended before any rank started (it refused the step),
        an UncompletedJobError with srun's own message instead of a wait for result files."""
        self.wait()
        process = self.srun
        folder = self.paths.folder
        if process is not None and not list(folder.glob(f"{self.job_id}_*_rank.json")):
            log = folder / f"{self.job_id}_srun.log"
            said = log.read_text(errors="replace")[-2000:] if log.exists() else "(no srun log)"
            lines = [line.strip() for line in said.splitlines() if line.strip()]
            reason = next((x for x in reversed(lines) if "error" in x), lines[-1] if lines else "")
            # srun's reason on the first line: error output shows a failed job in one line.
            raise utils.UncompletedJobError(
                f"the training step (srun) ended with status {process.returncode} before any "
                f"rank started; srun said: {reason} (log: {log})\n{said.rstrip()}"
            )
        return super().results()

    def done(self, force_check: bool = False) -> bool:
        """True once srun has ended (every rank of the step has)."""
        if self.srun is None:
            return self.paths.result_pickle.exists()
        return self.srun.poll() is not None

    @property
    def state(self) -> str:
        """RUNNING, FINISHED (srun exited), or INTERRUPTED (srun was killed)."""
        return self.get_info()["jobState"]

    def get_info(self, mode: str = "force") -> dict[str, str]:
        """The state in submitit's form, from the srun process."""
        if self.srun is None:
            return {"jobState": "FINISHED" if self.paths.result_pickle.exists() else "UNKNOWN"}
        code = self.srun.poll()
        state = "RUNNING" if code is None else ("INTERRUPTED" if code < 0 else "FINISHED")
        return {"jobState": state}

    def cancel(self, check: bool = True) -> None:
        """Cancel the step (Slurm ends every rank on every node), then wait for srun."""
        process = self.srun
        deadline = time.monotonic() + CANCEL_WAIT_S
        while process is not None and process.poll() is None:
            if cancel_step(self.job_id) or time.monotonic() > deadline:
                break
            time.sleep(0.5)  # srun has not created the step yet
        if process is None:
            cancel_step(self.job_id)
            return
        try:
            process.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


class AllocationExecutor(SubmititCommandHooks, core.PicklingExecutor):
    """Submits a function as one srun step of the current Slurm job (see the module doc)."""

    job_class = AllocationJob

    def __init__(self, folder: Path | str, python: str | None = None) -> None:
        super().__init__(folder, max_num_timeout=0)
        self.python = shlex.quote(sys.executable) if python is None else python
        self.slurm_job = allocation_job_id()

    @classmethod
    def _valid_parameters(cls) -> set[str]:
        return {
            "nodes",
            "tasks_per_node",
            "cpus_per_task",
            "gpus_per_node",
            "timeout_min",
            "exclude",
        }

    def _internal_update_parameters(self, **kwargs: Any) -> None:
        unknown = set(kwargs) - self._valid_parameters()
        if unknown:
            raise ValueError(f"AllocationExecutor does not take {sorted(unknown)}")
        super()._internal_update_parameters(**kwargs)

    def task_command(self) -> str:
        """submitit's own task command, as its Slurm and local executors build it."""
        return " ".join([self.python, "-u -m submitit.core._submit", shlex.quote(str(self.folder))])

    def _num_tasks(self) -> int:
        return int(self.parameters.get("nodes", 1)) * int(self.parameters.get("tasks_per_node", 1))

    def srun_argv(self, command: str, job_id: str) -> list[str]:
        """The srun command line of the step running `command` as every rank."""
        p = self.parameters
        paths = utils.JobPaths(self.folder, job_id=job_id, task_id=0)
        out = str(paths.stdout).replace(f"{job_id}_0_", f"{job_id}_%t_")
        err = str(paths.stderr).replace(f"{job_id}_0_", f"{job_id}_%t_")
        argv = ["srun", f"--job-name={STEP_PREFIX}{job_id}", "--overlap", "--unbuffered"]
        argv += [f"--nodes={p.get('nodes', 1)}", f"--ntasks={self._num_tasks()}"]
        argv += [f"--ntasks-per-node={p.get('tasks_per_node', 1)}"]
        argv += [f"--cpus-per-task={p.get('cpus_per_task', 1)}"]
        argv += [f"--time={p['timeout_min']}"] if p.get("timeout_min") else []
        argv += ["--gpus-per-task=1"] if p.get("gpus_per_node") else []
        argv += [f"--exclude={p['exclude']}"] if p.get("exclude") else []
        argv += [f"--output={out}", f"--error={err}", "--input=none"]
        return [*argv, "bash", "-c", _TASK_ENV, "trainflow-rank", *shlex.split(command)]

    def _submit_command(self, command: str) -> AllocationJob[Any]:
        job_id = f"{self.slurm_job}-{uuid.uuid4().hex[:8]}"
        folder = utils.JobPaths(self.folder, job_id=job_id).folder
        folder.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, "SUBMITIT_LOCAL_JOB_ID": job_id}
        for var in ("SUBMITIT_EXECUTOR", "SUBMITIT_FOLDER"):
            env.pop(var, None)
        with (folder / f"{job_id}_srun.log").open("ab") as srun_log:  # srun's own messages
            process = subprocess.Popen(
                self.srun_argv(command, job_id),
                stdin=subprocess.DEVNULL,
                stdout=srun_log,
                stderr=srun_log,
                env=env,
                # Not in the flow's process group: a terminal's Ctrl-C reaches the flow, which
                # cancels the step; srun itself would only print the tasks' status.
                start_new_session=True,
            )
        return AllocationJob(
            folder=self.folder, job_id=job_id, tasks=list(range(self._num_tasks())), process=process
        )

    def _make_submission_file_text(self, command: str, uid: str) -> str:
        return ""

    @staticmethod
    def _get_job_id_from_submission_command(string: bytes | str) -> str:
        return "0"  # not used: _submit_command starts srun itself

    def _make_submission_command(self, submission_file_path: Path) -> list[str]:
        return []  # not used: _submit_command starts srun itself
