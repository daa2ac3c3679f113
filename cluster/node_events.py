"""Which of a job's nodes Slurm took down, and why: the node events its database keeps.

A node set DOWN (``scontrol update NodeName=<n> State=DOWN Reason=...``, or by slurmctld when
its slurmd stops answering) ends every job on it with NODE_FAIL: Slurm requeues a batch job
(JobRequeue=1) and kills its processes on every node. Nothing of that reaches the job's own
files, and the node may be back in service already (ReturnToService=2 returns a node whose
slurmd answers at once: measured on the dev cluster, within 20 ms). What remains is the node
event in the accounting database, which ``sacctmgr show event`` lists.
"""

import subprocess
import time
from dataclasses import dataclass
from datetime import datetime


@dataclass(frozen=True)
class NodeEvent:
    """One node going down (or draining, failing) as slurmdbd recorded it."""

    node: str
    start: str
    """When it happened, as sacctmgr prints it (local time, ISO format)."""
    state: str
    """The node's state then: DOWN, DRAIN, FAIL, ..."""
    reason: str

    def __str__(self) -> str:
        return f"node {self.node} {self.state} at {self.start}, reason: {self.reason or '?'}"


def expand_nodes(nodelist: str) -> list[str]:
    """Slurm's compact node list (``tfnode[1-2]``, ``gpu[01-03,7],login1``, ``r[1-2]n[1-2]``)
    as names, in Slurm's order; [] for none.

    Parsed here, not by ``scontrol show hostnames`` (it needs the cluster's configuration and
    waits up to a minute without it) nor by submitit (only a private function of it parses).
    """
    if not nodelist or nodelist == "None assigned":
        return []
    return [name for item in _top_level(nodelist) for name in _expand(item)]


def _top_level(nodelist: str) -> list[str]:
    """The comma-separated items of a node list, commas inside brackets kept."""
    items, depth, start = [], 0, 0
    for i, char in enumerate(nodelist):
        depth += {"[": 1, "]": -1}.get(char, 0)
        if char == "," and depth == 0:
            items.append(nodelist[start:i])
            start = i + 1
    return [*items, nodelist[start:]]


def _expand(item: str) -> list[str]:
    """One item's names: its first bracket's ranges (zero-padded to the range's start), each
    followed by the rest of the item, expanded the same way."""
    opening = item.find("[")
    if opening < 0:
        return [item]
    closing = item.index("]", opening)
    head, ranges, tail = item[:opening], item[opening + 1 : closing], item[closing + 1 :]
    names = []
    for part in ranges.split(","):
        low, _, high = part.partition("-")
        for number in range(int(low), int(high or low) + 1):
            names += [f"{head}{number:0{len(low)}d}{rest}" for rest in _expand(tail)]
    return names


def node_events(nodes: list[str], since: str, wait_s: float = 10.0) -> list[NodeEvent]:
    """The events of `nodes` that started at or after `since` (sacct's time format).

    slurmctld hands events to slurmdbd a moment after the node changed: asked again for up
    to `wait_s` while none shows. [] when there is none, or sacctmgr fails (the caller then
    names the job's nodes without knowing which one failed).
    """
    if not nodes:
        return []
    cmd = ["sacctmgr", "-n", "-P", "show", "event", f"Nodes={','.join(nodes)}", f"Start={since}"]
    cmd += ["format=NodeName,TimeStart,State,Reason"]
    deadline = time.monotonic() + wait_s
    while True:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
        rows = [line.split("|") for line in out.stdout.splitlines()] if out.returncode == 0 else []
        events = [NodeEvent(*row[:4]) for row in rows if len(row) >= 4 and row[0] in nodes]
        if events or time.monotonic() >= deadline:
            return events
        time.sleep(1.0)


def node_failed(job_ids: list[str], submitted_after: datetime) -> set[str]:
    """The jobs among `job_ids` that Slurm ended with NODE_FAIL since `submitted_after`.

    One sacct call over every attempt (--duplicates): Slurm requeues such a job at once, so its
    latest record (all submitit reads) soon says PENDING or RUNNING again, and the failed
    attempt shows only in the earlier record. Empty when sacct fails (asked again later).
    """
    if not job_ids:
        return set()
    cmd = ["sacct", "-X", "-P", "-n", "--duplicates", "-o", "JobID,State,Submit"]
    cmd += ["-j", ",".join(job_ids)]
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return set()
    failed = set()
    for line in out.stdout.splitlines() if out.returncode == 0 else []:
        job_id, state, submit = [*line.split("|"), "", ""][:3]
        if job_id in job_ids and state == "NODE_FAIL" and _after(submit, submitted_after):
            failed.add(job_id)
    return failed


def _after(submit: str, when: datetime) -> bool:
    try:
        return datetime.fromisoformat(submit) >= when
    except ValueError:
        return True  # "Unknown"
