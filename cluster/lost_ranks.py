"""Naming what ended a failed job: which rank, on which node, how, and where its log is.

Each rank of a trainflow job runs under cluster.rank_guard, which leaves beside submitit's
files ``<job id>_<task>_rank.json`` (node, pid) when the rank starts and
``<job id>_<task>_exit.json`` (exit code or signal, OOM kill) when it ends. Together with the
result pickles (("error", traceback) from a rank that raised) they tell a lost rank (killed by a
signal, or gone without a result) from the survivors whose collectives then failed: the lost
rank leads the message, the survivors' errors follow as detail.
"""

import json
import re
import signal
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import submitit
from submitit.core.utils import pickle_load

from trainflow.cluster.accounting import sacct_records
from trainflow.cluster.node_events import expand_nodes, node_events
from trainflow.errors import JobError


@dataclass(frozen=True)
class RankEnd:
    """How one rank of a job ended, as far as its files tell."""

    task: int
    """Global rank."""
    node: str | None
    """The node it ran on (None: it never started)."""
    returncode: int | None
    """Its exit code, negative for a signal; None when no exit was recorded."""
    oom_kill: bool
    """True when the kernel counted an OOM kill in its cgroup as it died."""
    outcome: str | None
    """'success' or 'error' from its result pickle; None without one."""
    traceback: str | None
    """The traceback text of a rank that raised."""
    ended: float
    """When it ended (or its result was written), for ordering; 0 when unknown."""
    log: Path
    """Its stderr log."""
    ended_for_peer: int | None = None
    """The peer whose end made this rank's guard end it (cluster.rank_guard), if so: a
    survivor, neither lost nor the cause."""
    hung: dict[str, Any] | None = None
    """What its guard recorded when it ended it as hung (cluster.hang_watch.HangWatch): phase,
    step, silent_s, allowed_s, since (its last heartbeat's time), frame; None when it was
    not."""

    @property
    def failed(self) -> bool:
        """It raised, or ended without a successful result."""
        if self.outcome == "success":
            return False
        return self.outcome == "error" or self.node is not None

    @property
    def lost(self) -> bool:
        """It ended without raising: killed by a signal, exited without a result, or vanished
        (no exit record: its node, or everything on it, went away)."""
        return self.failed and self.outcome != "error" and self.ended_for_peer is None

    @property
    def raised(self) -> str | None:
        """What a rank that raised raised, as 'DataError: cannot read shard ...' (one line)."""
        return raised_line(self.traceback) if self.outcome == "error" else None

    def how(self) -> str:
        """How it ended, in words: 'raised DataError: ...', 'was killed by signal 9 (SIGKILL)',
        'exited with code 3', ..."""
        where = f"rank {self.task} on node {self.node or '?'}"
        if self.outcome == "error":
            return f"{where} raised {self.raised}"
        if self.ended_for_peer is not None:
            return f"{where} was ended by its guard after rank {self.ended_for_peer} ended"
        if self.hung is not None:
            hung = self.hung
            frame = f"; stuck at {hung['frame']}" if hung.get("frame") else ""
            return (
                f"{where} hung in phase {hung.get('phase')} for {float(hung['silent_s']):.0f} s "
                f"(no progress since step {hung.get('step')}{frame}): its stacks are in "
                f"{self.log}"
            )
        if self.returncode is None:
            return f"{where} vanished without an exit status (its node or its parent died)"
        if self.returncode < 0:
            sig = -self.returncode
            name = signal.Signals(sig).name if sig in set(signal.Signals) else "?"
            oom = ": an OOM kill (the kernel's memory.events counted one)" if self.oom_kill else ""
            return f"{where} was killed by signal {sig} ({name}){oom}"
        return f"{where} exited with code {self.returncode} without a result"

    @property
    def since(self) -> float:
        """When it stopped: a hung rank's last heartbeat, else its end (inf when unknown): the
        first lost rank of a job is the one that stopped first."""
        if self.hung is not None and isinstance(self.hung.get("since"), (int, float)):
            return float(self.hung["since"])
        return self.ended or float("inf")

    def told(self) -> str:
        """how(), with its log named (a hung rank's how() names it already)."""
        return self.how() if self.hung is not None else f"{self.how()}, log: {self.log}"


class RankLostError(JobError):
    """A job ended because a rank was lost (killed, or its node gone), not because one raised:
    the case cluster.restarts restarts."""

    def __init__(
        self,
        message: str,
        lost: list[RankEnd] | None = None,
        nodes: list[str] | None = None,
        detail: str = "",
    ) -> None:
        super().__init__(message, detail)
        self.lost = lost or []
        """The lost ranks, the first lost first."""
        self.nodes = sorted(nodes if nodes is not None else {e.node for e in self.lost if e.node})
        """The nodes lost (a restart avoids them): given, or those of the lost ranks."""


class RankHungError(RankLostError):
    """A job ended because a rank made no progress for longer than its phase allows (its guard
    ended it, cluster.rank_guard): restarted like a lost rank."""


def raised_line(trace: str | None) -> str:
    """The exception a Python traceback text ends with, as one line: its type without the
    module path, then the first line of its message ('(more in the log)' when it has more).

    The last exception of a chain is the one raised: it follows the last frame ('  File ...'
    and its indented source lines) of the text."""
    lines = (trace or "").rstrip().splitlines()
    if not lines:
        return "an exception (no traceback recorded)"
    frames = [i for i, line in enumerate(lines) if line.startswith(("  File ", "Traceback ("))]
    first = frames[-1] + 1 if frames else 0
    while first < len(lines) - 1 and lines[first].startswith("    "):
        first += 1
    name, colon, message = lines[first].partition(": ")
    if re.fullmatch(r"[\w.]+", name):
        name = name.rsplit(".", 1)[-1]
    more = " (more in the log)" if first < len(lines) - 1 else ""
    return f"{name}{colon}{message}{more}"


def _read_json(path: Path) -> dict[str, Any] | None:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def rank_ends(job: submitit.Job[Any]) -> list[RankEnd]:
    """What every rank of `job` left behind, by rank."""
    ends = []
    for k in range(job.num_tasks):
        paths = job.task(k).paths
        base = paths.result_pickle.name.removesuffix("_result.pkl")
        started = _read_json(paths.folder / f"{base}_rank.json") or {}
        exited = _read_json(paths.folder / f"{base}_exit.json") or {}
        outcome, trace, ended = None, None, float(exited.get("ended", 0.0))
        if paths.result_pickle.exists():
            outcome, payload = pickle_load(paths.result_pickle)
            trace = str(payload) if outcome == "error" else None
            ended = ended or paths.result_pickle.stat().st_mtime
        node = exited.get("node") or started.get("node")
        code = exited.get("returncode")
        for_peer = exited.get("ended_for_peer")
        hung = exited.get("hung")
        ends.append(
            RankEnd(
                k,
                node,
                code if isinstance(code, int) else None,
                bool(exited.get("oom_kill")),
                outcome,
                trace,
                ended,
                paths.stderr,
                for_peer if isinstance(for_peer, int) else None,
                hung if isinstance(hung, dict) and "silent_s" in hung else None,
            )
        )
    return ends


PEER_LOSS = (
    "Connection closed by peer",
    "Connection reset by peer",
    "remote worker crashing",
    "remote process exited",
    "DistNetworkError",
    "Broken pipe",
)
"""What a rank's last error line says when its collective lost a peer (gloo, NCCL, the store)."""


def _collateral(end: RankEnd) -> bool:
    """True when `end` raised only because a peer went away."""
    lines = (end.traceback or "").strip().splitlines()
    return bool(lines) and any(sign in lines[-1] for sign in PEER_LOSS)


def failure_message(job: submitit.Job[Any], ends: list[RankEnd]) -> tuple[str, str] | None:
    """(message, detail) of a failed job, None when no rank failed.

    The message is one line: a lost rank comes first (the cause: its peers then fail in their
    collectives), with its node, how it ended and its log; else the rank that raised first,
    with what it raised ('DataError: cannot read shard ...') and its log. The detail holds the
    tracebacks of the ranks that raised, the first to fail first, and the job's log folder:
    `trainflow --debug` shows it (the ranks' logs keep it too).
    """
    failed = [end for end in ends if end.failed]
    if not failed:
        return None
    lost = sorted((e for e in failed if e.lost), key=lambda e: (e.since, e.task))
    # A rank whose error is its collective losing a peer is collateral: the rank that raised
    # something else is the cause and leads, even when it took longer to exit.
    raised = sorted(
        (e for e in failed if not e.lost),
        key=lambda e: (e.ended_for_peer is not None, _collateral(e), e.ended, e.task),
    )
    if lost:
        first = lost[0]
        message = f"job {job.job_id} lost rank {first.task} (node {first.node or '?'}): "
        message += "; ".join(e.told() for e in lost)
        if raised:
            message += (
                f"; then rank(s) {[e.task for e in raised]} failed (detail: their collectives "
                "lost their peer)"
            )
    else:
        later = f", then rank(s) {[e.task for e in raised[1:]]}" if len(raised) > 1 else ""
        first = raised[0]
        message = f"job {job.job_id} failed in rank {first.task}{later}: {first.how()}, "
        message += f"log: {first.log}"
    detail = []
    for end in raised:
        detail += [f"----- rank {end.task} (node {end.node or '?'}) traceback -----"]
        detail.append((end.traceback or "").rstrip())
    detail.append(f"logs: {job.paths.folder}")
    return message, "\n".join(detail)


def node_failure(job: submitit.Job[Any], ends: list[RankEnd]) -> RankLostError:
    """The error of a job Slurm ended with NODE_FAIL (a node set DOWN or gone): the nodes that
    went down (cluster.node_events) lead, with their reason, then the ranks that ran there.

    Without a recorded event the message names the job's nodes and no node is held lost, so
    a restart may go anywhere.
    """
    failed = [r for r in sacct_records(str(job.job_id)) if r.get("State") == "NODE_FAIL"]
    record = failed[-1] if failed else {}
    nodes = expand_nodes(record.get("NodeList", ""))
    events = node_events(nodes, record.get("Submit", "now-3600"))
    down = sorted({event.node for event in events})
    if down:
        head = f"job {job.job_id} lost node {', '.join(down)}: Slurm ended it with NODE_FAIL ("
        head += "; ".join(map(str, events)) + ")"
    else:
        head = f"job {job.job_id} lost one of its nodes ({', '.join(nodes) or '?'}): Slurm ended "
        head += "it with NODE_FAIL (no node event recorded: which node is unknown)"
    there = [end for end in ends if end.node in down]
    if there:
        head += f"; rank(s) {[e.task for e in there]} ran there, log: {there[0].log}"
    return RankLostError(head, there, down, detail=f"logs: {job.paths.folder}")
