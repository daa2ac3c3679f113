"""What a finished Slurm job cost, from one sacct call.

``sacct -X --duplicates`` lists one allocation record per attempt of the job: a requeued job
(timeout with checkpoint, preemption, ``scontrol requeue``) keeps its id, its earlier
attempts stay as records in state REQUEUED, and the last record is the attempt that counts.
So requeues = records - 1, and costs add up over every attempt (each held its resources).
A requeued attempt's Submit time is its requeue time, never earlier than the first one's:
records submitted before the watcher's submission belong to an older job that had the same
id (ids restart at 1 when a cluster's state is wiped but its database is kept).
``Restarts`` is not an sacct field; scontrol's ``Restarts=`` exists only while the
controller still remembers the job (MinJobAge, 300 s by default), so it is not used.
"""

import subprocess
import time
from datetime import datetime

# Allocation records (-X) of every attempt (--duplicates), machine-readable (-P, no header).
_FIELDS = (
    "JobID",
    "State",
    "Submit",
    "ElapsedRaw",
    "AllocTRES",
    "ConsumedEnergyRaw",
    "NodeList",
)
_NOT_FINAL = {
    "PENDING",
    "RUNNING",
    "REQUEUED",
    "REQUEUE_HOLD",
    "REQUEUE_FED",
    "COMPLETING",
    "CONFIGURING",
    "SUSPENDED",
    "RESIZING",
    "SIGNALING",
    "STAGE_OUT",
}


def job_accounting(
    job_id: str, submitted_after: datetime | None = None, wait_s: float = 20.0
) -> dict[str, float | str]:
    """State, elapsed seconds, requeues, CPU/GPU hours (and energy if measured) of a job.

    Keys: job_id, state (e.g. COMPLETED, FAILED, CANCELLED, TIMEOUT), elapsed_s (all attempts),
    requeues, nodes and node_list (of the last attempt, in Slurm's form: ``tfnode[1-2]``),
    cpu_hours, gpu_hours (over all nodes), and
    energy_j only when the cluster measures energy.
    Records reach sacct a little after the job ends: retried for up to `wait_s` until the
    last attempt shows a final state (then returned as it is). `submitted_after` (local time,
    as sacct prints it) leaves out older jobs with the same id. RuntimeError if sacct knows
    nothing of the job or fails.
    """
    deadline = time.monotonic() + wait_s
    while True:
        records = sacct_records(job_id, submitted_after)
        final = records and _state(records[-1]) not in _NOT_FINAL
        if final or time.monotonic() >= deadline:
            break
        time.sleep(1.0)
    if not records:
        after = f" submitted after {submitted_after:%Y-%m-%dT%H:%M:%S}" if submitted_after else ""
        raise RuntimeError(f"sacct has no record of job {job_id}{after} (is accounting on?)")
    return summarize(job_id, records)


def sacct_records(job_id: str, submitted_after: datetime | None = None) -> list[dict[str, str]]:
    """The allocation record of every attempt of `job_id`, oldest first."""
    cmd = ["sacct", "-j", job_id, "-X", "-P", "--duplicates", "--noheader"]
    cmd += ["-o", ",".join(_FIELDS)]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
    if out.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed: {out.stderr.strip() or out.returncode}")
    rows = [dict(zip(_FIELDS, line.split("|"), strict=False)) for line in out.stdout.splitlines()]
    # -j 12 also matches array elements 12_0...; keep this job's own records.
    rows = [r for r in rows if r.get("JobID") == job_id]
    if submitted_after is None:
        return rows
    return [r for r in rows if _submitted(r) >= submitted_after]


def _submitted(record: dict[str, str]) -> datetime:
    try:
        return datetime.fromisoformat(record.get("Submit", ""))
    except ValueError:
        return datetime.max  # "Unknown": keep the record


def summarize(job_id: str, records: list[dict[str, str]]) -> dict[str, float | str]:
    """Accounting of a job from its sacct records (oldest first)."""
    elapsed = [float(r.get("ElapsedRaw") or 0) for r in records]
    tres = [_tres(r.get("AllocTRES", "")) for r in records]
    acct: dict[str, float | str] = {
        "job_id": job_id,
        "state": _state(records[-1]),
        "elapsed_s": sum(elapsed),
        "requeues": float(len(records) - 1),
        "nodes": tres[-1].get("node", 0.0),
        "node_list": records[-1].get("NodeList", "None assigned"),
        "cpu_hours": sum(t.get("cpu", 0.0) * s for t, s in zip(tres, elapsed, strict=True)) / 3600,
        "gpu_hours": sum(t.get("gres/gpu", 0.0) * s for t, s in zip(tres, elapsed, strict=True))
        / 3600,
    }
    # 0 (or empty) means no energy plugin: a job that ran cannot have used no energy.
    energy = sum(_number(r.get("ConsumedEnergyRaw", "")) for r in records)
    if energy > 0:
        acct["energy_j"] = energy
    return acct


def _state(record: dict[str, str]) -> str:
    # "CANCELLED by 0" -> "CANCELLED"
    return (record.get("State") or "UNKNOWN").split()[0]


def _tres(text: str) -> dict[str, float]:
    """`billing=2,cpu=2,gres/gpu=2,mem=1G,node=1` -> counts of the countable entries."""
    pairs = (item.split("=", 1) for item in text.split(",") if "=" in item)
    return {key: _number(value) for key, value in pairs}


def _number(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        return 0.0  # e.g. mem=1G, or an empty field
