"""Watching a submitted job: forward its logs, report failures, cancel it if the watcher stops.

Each task (rank) of a submitit job writes ``<folder>/<job id>_<task>_log.out`` / ``.err`` and,
when it ends, ``<job id>_<task>_result.pkl`` holding ("success", value) or ("error",
traceback text). Reading those files costs the scheduler nothing.

A failure is reported when the job has ended, not at the first error file: during a requeue
(timeout, preemption) rank 0 exits on purpose and its peers fail on the closed connection,
leaving error files that the next attempt overwrites. Peers of a crashed rank do not hang:
the training job's process group fails them fast (gloo) or after its timeout (nccl). The
message names the lost rank, its node, how it ended and its log (cluster.lost_ranks).
"""

import json
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

import submitit
from submitit.core.utils import FailedJobError, UncompletedJobError
from submitit.local.debug import DebugJob

from trainflow.cluster import forwarded, registry
from trainflow.cluster.job_folder import check_private
from trainflow.cluster.lost_ranks import (
    RankHungError,
    RankLostError,
    failure_message,
    node_failure,
    raised_line,
    rank_ends,
)
from trainflow.cluster.node_events import node_failed
from trainflow.cluster.srun_executor import AllocationJob, step_state
from trainflow.errors import JobError


class LogTail:
    """Follows a growing log file and hands back its new complete lines.

    With `where` (the rank's ``_rank.json`` from cluster.rank_guard), the prefix names the
    Slurm node the rank runs on as soon as that file appears: ``[rank1@tfnode2] ``.
    """

    def __init__(self, path: Path, prefix: str, where: Path | None = None) -> None:
        self.path = path
        self.prefix = prefix
        self._where = where
        self._offset = 0
        self._partial = ""

    def _add_node(self) -> None:
        assert self._where is not None
        try:
            node = json.loads(self._where.read_text()).get("slurm_node")
        except (OSError, ValueError):
            return
        self._where = None
        if node:
            self.prefix = f"{self.prefix.rstrip()[:-1]}@{node}] "

    def new_lines(self, final: bool = False) -> list[str]:
        """Complete lines written since the last call (with `final`, the unfinished one too)."""
        if self._where is not None:
            self._add_node()
        if self.path.exists():
            with self.path.open("rb") as f:
                f.seek(self._offset)
                chunk = f.read()
            self._offset += len(chunk)
            self._partial += chunk.decode("utf-8", errors="replace")
        *lines, self._partial = self._partial.split("\n")
        if final and self._partial:
            lines, self._partial = [*lines, self._partial], ""
        return [self.prefix + line for line in lines]


def log_tails(job: submitit.Job[Any], label: str = "") -> list[LogTail]:
    """A tail on the stdout and stderr of every task of `job`, prefixed with its rank."""
    tails = []
    for k in range(job.num_tasks):
        paths = job.task(k).paths
        prefix = f"[{label}rank{k}] "
        where = paths.folder / paths.result_pickle.name.replace("_result.pkl", "_rank.json")
        tails += [LogTail(paths.stdout, prefix, where), LogTail(paths.stderr, prefix, where)]
    return tails


def _forward(tails: list[LogTail], log: Callable[[str], None], final: bool = False) -> None:
    for tail in tails:
        token = forwarded.STREAM.set(str(tail.path))  # one traceback filter state per file
        try:
            for line in tail.new_lines(final):
                log(line)
        finally:
            forwarded.STREAM.reset(token)


def _cancel_quietly(job: submitit.Job[Any]) -> None:
    """Cancel the job; never let a failing cancel hide the error that caused it. A cancel the
    scheduler refused (slurmctld did not answer) goes to the job's watchdog, which retries it
    (cluster.registry.hand_over): the job never trains on unwatched."""
    try:
        if isinstance(job, submitit.SlurmJob):
            why = registry.scancel([str(job.job_id)], timeout_s=CANCEL_TIMEOUT_S)
        else:
            job.cancel(check=False)
            why = ""
    except Exception as exc:
        why = f"{type(exc).__name__}: {exc}"
    if why:
        handed = registry.hand_over(str(job.job_id), why)
        then = "its watchdog keeps trying" if handed else f"cancel it: scancel {job.job_id}"
        print(f"trainflow: could not cancel job {job.job_id} ({why}); {then}", file=sys.stderr)


CANCEL_TIMEOUT_S = 20.0
"""How long the watcher's own scancel may take (a controller that does not answer makes it
wait MessageTimeout, 10 s by default) before the cancel goes to the watchdog: well inside a
Prefect cancel's 30 s grace before SIGKILL."""


POLL_S = 0.25
"""Seconds between checks of a job's state (and log forwards) while waiting for it."""
LOCAL_POLL_S = 0.05
"""The same for jobs of the local executor only: their state is a local process's exit
status (no sacct), so the flow learns of a job's end 0.1 s sooner on average for nothing."""

NODE_CHECK_S = 10.0
"""How often sacct is asked, while a Slurm job is followed, whether a node failure ended it. A
node set DOWN (or lost) leaves no file behind, Slurm requeues the job at once, and submitit,
which reads only the latest record and at most every min(600 s, half the job's age), would
never see it end: with this, trainflow ends such a job within NODE_CHECK_S and a few seconds."""


class _Ended:
    """Whether every job has ended, by submitit or (Slurm) by a node failure."""

    def __init__(self) -> None:
        self._checked = time.monotonic()
        # A minute of slack for the controller's clock: older jobs with these ids (a wiped dev
        # cluster restarts ids at 1) were submitted before it.
        self._since = datetime.now() - timedelta(minutes=1)
        self.node_failed: set[str] = set()
        """Ids of the jobs Slurm ended with NODE_FAIL."""

    def __call__(self, jobs: list[submitit.Job[Any]]) -> bool:
        slurm = [str(job.job_id) for job in jobs if isinstance(job, submitit.SlurmJob)]
        if slurm and time.monotonic() - self._checked >= NODE_CHECK_S:
            self._checked = time.monotonic()
            self.node_failed |= node_failed(slurm, self._since)
        return all(str(job.job_id) in self.node_failed or job.done() for job in jobs)


def _cancel_and_wait(job: submitit.Job[Any], wait_s: float = 60.0) -> None:
    """Cancel a Slurm job and wait until squeue no longer lists it: its processes have then
    ended on every node (Slurm keeps a job COMPLETING until they have). Gives up silently after
    `wait_s`, a guard against a controller that does not answer."""
    _cancel_quietly(job)
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        cmd = ["squeue", "-h", "-j", str(job.job_id), "-o", "%T"]
        try:
            out = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
        except (OSError, subprocess.TimeoutExpired):
            out = None
        if out is not None and not out.stdout.strip():  # gone (or purged: "Invalid job id")
            return
        time.sleep(1.0)


def _follow(
    job: submitit.Job[Any],
    tails: list[LogTail],
    log: Callable[[str], None],
    poll_s: float,
    ended: _Ended,
) -> None:
    """Forward logs until the job has ended."""
    while not ended([job]):
        _forward(tails, log)
        time.sleep(poll_s)
    _forward(tails, log, final=True)


def _run_debug(job: DebugJob[Any]) -> Any:
    """Run a debug job here, without submitit's post-mortem debugger on failure."""
    try:
        with submitit.helpers.environment_variables(SUBMITIT_DEBUG_JOB_ID=job.job_id):
            return job.submission().result()
    except Exception as exc:
        trace = traceback.format_exc()
        raise JobError(f"debug job failed: {raised_line(trace)}", trace) from exc


def wait_for_job(
    job: submitit.Job[Any], log: Callable[[str], None], poll_s: float | None = None
) -> Any:
    """Wait for `job` while forwarding its logs to `log`; return the result of task 0.

    If waiting is interrupted (KeyboardInterrupt, a cancelled flow, any error), the job is
    cancelled before the exception propagates: no job outlives the run that watches it.
    A failed job raises JobError: one line naming the rank that failed first (usually the
    cause; its peers then lose their connection), what it raised and its log; the remote
    tracebacks of the failed ranks in its `detail`.
    """
    if isinstance(job, DebugJob):
        return _run_debug(job)
    ended = _Ended()
    try:  # from the first instruction: an interrupt anywhere in here cancels the job
        tails = log_tails(job)
        _follow(job, tails, log, poll_s or _poll_s([job]), ended)
    except BaseException:
        _cancel_quietly(job)
        raise
    outcome = _outcome(job, ended.node_failed)
    if isinstance(outcome, JobError):
        raise outcome
    return outcome


def wait_for_jobs(
    jobs: list[submitit.Job[Any]], log: Callable[[str], None], poll_s: float | None = None
) -> list[Any]:
    """Wait for several jobs (e.g. a job array) at once, forwarding all their logs.

    Returns, per job, the result of its task 0 or the JobError that job failed with: one
    failed element does not discard the others. Interrupted waiting cancels every job.
    """
    debug = [job for job in jobs if isinstance(job, DebugJob)]
    if debug:
        return [_debug_outcome(job) for job in debug]
    ended = _Ended()
    poll_s = poll_s or _poll_s(jobs)
    try:
        tails = [t for i, job in enumerate(jobs) for t in log_tails(job, f"{i} ")]
        while not ended(jobs):
            _forward(tails, log)
            time.sleep(poll_s)
        _forward(tails, log, final=True)
    except BaseException:
        for job in jobs:
            _cancel_quietly(job)
        raise
    return [_outcome(job, ended.node_failed) for job in jobs]


def _poll_s(jobs: list[submitit.Job[Any]]) -> float:
    local = all(isinstance(job, submitit.LocalJob) for job in jobs)
    return LOCAL_POLL_S if local else POLL_S


def _outcome(job: submitit.Job[Any], node_failed: set[str]) -> Any:
    """Task 0's result of an ended job, or the JobError it failed with: the lost rank, or the
    rank that raised and what it raised, named (tracebacks in its detail). JobError, before
    any pickle is loaded (loading one runs code), when the job folder or a result pickle is
    not private to this user."""
    check_private(job.paths.folder, [job.task(k).paths.result_pickle for k in range(job.num_tasks)])
    ends = rank_ends(job)
    failure = failure_message(job, ends)
    message, detail = failure or ("", "")
    if failure and (str(job.job_id) in node_failed or _node_failed(job)):
        # Slurm requeued it (JobRequeue): its next attempt must not run beside a restart.
        _cancel_and_wait(job)
        return node_failure(job, ends)
    lost = sorted((e for e in ends if e.lost), key=lambda e: (e.since, e.task))
    if failure and lost and not _cancelled(job):
        if lost[0].hung is not None:
            return RankHungError(message, lost, detail=detail)
        return RankLostError(message, lost, detail=detail)
    if failure and any(end.outcome == "error" for end in ends):
        return JobError(message, detail)
    try:
        # results(), not result(): the latter refuses multi-task jobs after waiting.
        return job.results()[0]
    except (FailedJobError, UncompletedJobError) as exc:
        head = message or f"job {job.job_id} did not complete"
        said = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        return JobError(f"{head}: {said}", f"{detail}\n{exc}".strip())


def _cancelled(job: submitit.Job[Any]) -> bool:
    """Whether Slurm says the job (or the allocation's training step) was cancelled (scancel):
    its killed ranks are no loss."""
    if isinstance(job, AllocationJob):
        # "CANCELLED by <uid>": a scancel. A step whose task died of SIGKILL (a lost rank) is
        # recorded as plain "CANCELLED".
        return step_state(job.job_id).startswith("CANCELLED by")
    return isinstance(job, submitit.SlurmJob) and job.state.startswith("CANCELLED")


def _node_failed(job: submitit.Job[Any]) -> bool:
    """Whether submitit last saw the job in state NODE_FAIL (a node failed or was set DOWN)."""
    return isinstance(job, submitit.SlurmJob) and job.state == "NODE_FAIL"


def _debug_outcome(job: DebugJob[Any]) -> Any:
    try:
        return _run_debug(job)
    except JobError as err:
        return err
