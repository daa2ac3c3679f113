"""Time limits never cost work: checkpoint at a step boundary before the limit, then requeue.

A job with a time limit (Slurm's, or the local executor's) learns once per attempt when it
must have finished: the limit less `train.time_limit_margin_s`. Rank 0 then
plans from what it measures as it goes: the seconds a step takes, the last checkpoint save
and the last validation pass. At planned step boundaries (a few per epoch, more as the limit
nears) rank 0 broadcasts its plan, so every rank stops at the same step: the job checkpoints
there (mid-epoch if need be: the data order of an epoch depends only on its seed and number,
so the next attempt skips the batches done) and requeues through submitit's own path.

The plan (`plan`): when the rest of the epoch, its validation and its checkpoint fit in the
time left, nothing happens before the epoch's end (a look again once half the slack is
spent); else the job stops after as many steps as leave time for one save, and looks again
halfway there, with fresher measurements.

The requeue signal (`cluster.signal_delay_s` before the limit; Slurm checks limits every 30 s
and sends it up to that much earlier) is the backstop: rank 0 holds a time limit's signal
until just before the limit itself (`hold_limit_signal`; the margin is the job's, so a step
that runs late or a save in progress still ends first) and lets it act only if the job has not
requeued itself by then. A signal far from the limit is a preemption and acts at once. Only
the first signal that acts requeues: a second `scontrol requeue` of a job being requeued fails.
"""

import os
import signal
import subprocess
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import FrameType
from typing import Any, NoReturn

import torch
import torch.distributed as dist

from trainflow.console import say
from trainflow.tasks.train.distributed import DistContext

SAVE_FACTOR = 1.5
"""A save is planned to take this many times the last one measured."""
FIRST_SAVE_S = 5.0
"""What a save is taken to cost before one was measured (no checkpoint written yet)."""
SIGNAL_EARLY_S = 45.0
"""How much earlier than its delay a time limit's requeue signal may come (Slurm checks limits
every 30 s), with slack: a signal within this of `signal_delay_s` before the limit is the
limit's, one earlier a preemption's."""
LAST_S = 5.0
"""A held limit signal acts this long before the limit (at most half the job's margin): the
backstop, with time left for submitit's requeue before Slurm ends the job."""
LOCAL_TIMEOUT_ENV = "SUBMITIT_LOCAL_TIMEOUT_S"
_requeueing = threading.Event()
"""Set once the job requeues itself: its own signal is never held."""
_acted = threading.Event()
"""Set once a requeue signal reached the acting handler: later ones are dropped."""
LOCAL_SIGNAL_ENV = "SUBMITIT_LOCAL_SIGNAL_DELAY_S"


@dataclass(frozen=True)
class Plan:
    """What rank 0 decided at a step boundary, in steps from there."""

    stop_in: int | None
    """Steps until the job checkpoints and requeues (0: now); None: not in this epoch."""
    check_in: int
    """Steps until the next look (at least 1; the epoch's length: none in this epoch)."""


def plan(
    remaining_s: float, steps_left: int, step_s: float | None, save_s: float, eval_s: float
) -> Plan:
    """The plan at a step boundary with `steps_left` steps left in the epoch.

    `remaining_s`: seconds until the job must have checkpointed; `step_s`: measured seconds a
    step (None before any was measured in this attempt); `save_s`: the last save's seconds;
    `eval_s`: the last validation pass's seconds (what an epoch's end adds before its save).
    A stop always leaves at least one step of the epoch to do, so the next attempt still ends
    the epoch the way an uninterrupted run does.
    """
    save = save_s * SAVE_FACTOR
    if step_s is None:  # nothing measured yet: one step, then a look
        return Plan(0 if remaining_s <= save else None, 1)
    step_s = max(step_s, 1e-6)
    slack = remaining_s - steps_left * step_s - eval_s - save
    if slack > 0:  # the epoch, its validation and its checkpoint fit
        return Plan(None, min(max(int(slack / 2 / step_s), 1), max(steps_left, 1)))
    fit = int((remaining_s - save) // step_s) if remaining_s > save else 0
    stop = min(fit, max(steps_left - 1, 0))
    return Plan(stop, max(stop // 2, 1))


def parse_time_left(text: str) -> float | None:
    """Seconds in squeue's %L ("[days-][hours:]minutes:seconds"); None for UNLIMITED etc."""
    text = text.strip()
    days, _, clock = text.rpartition("-")
    parts = clock.split(":")
    if not all(p.isdigit() for p in parts) or not 1 <= len(parts) <= 3:
        return None
    seconds = 0
    for part in parts:
        seconds = 60 * seconds + int(part)
    return seconds + 86_400 * int(days or 0) if (days or "0").isdigit() else None


def has_time_limit() -> bool:
    """Whether this rank runs under a time limit trainflow can read (the same on every rank)."""
    return LOCAL_TIMEOUT_ENV in os.environ or "SLURM_JOB_ID" in os.environ


def signal_delay(slurm_delay_s: float) -> float:
    """Seconds before the limit that the requeue signal comes: the local executor's (from its
    environment), else Slurm's (cluster.signal_delay_s, handed to the job)."""
    return float(os.environ.get(LOCAL_SIGNAL_ENV, slurm_delay_s))


def seconds_left() -> float | None:
    """Seconds from now until this job's time limit, or None when it has no limit or the
    limit cannot be read.

    Slurm: `squeue -o %L` for this job (one call, rank 0, once per attempt). Local executor:
    its SUBMITIT_LOCAL_TIMEOUT_S counted from when the rank's guard started.
    """
    if LOCAL_TIMEOUT_ENV in os.environ:
        elapsed = time.time() - _attempt_started()
        return float(os.environ[LOCAL_TIMEOUT_ENV]) - elapsed
    job_id = squeue_job_id(os.environ)
    if job_id is None:
        return None
    try:
        out = subprocess.run(
            ["squeue", "-h", "-j", job_id, "-o", "%L"],
            capture_output=True,
            text=True,
            timeout=30,
            check=True,
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    return parse_time_left(out)


def squeue_job_id(env: Mapping[str, str]) -> str | None:
    """The id that names this job alone in squeue: `<array job id>_<task id>` for an element
    of a job array (the last element started runs under the array's own job id, and `-j` with
    that id lists every element of the array), else SLURM_JOB_ID; None outside Slurm."""
    array, task = env.get("SLURM_ARRAY_JOB_ID"), env.get("SLURM_ARRAY_TASK_ID")
    if array and task:
        return f"{array}_{task}"
    return env.get("SLURM_JOB_ID")


def _attempt_started() -> float:
    """When the local controller started this attempt: the rank's guard's start (its parent),
    else this process's."""
    import psutil

    me = psutil.Process()
    parent = me.parent()
    if parent is not None and "trainflow.cluster.rank_guard" in " ".join(parent.cmdline()):
        return float(parent.create_time())
    return float(me.create_time())


@dataclass
class Estimates:
    """What rank 0 has measured (carried in checkpoints, so an attempt starts informed)."""

    step_s: float | None = None
    save_s: float = FIRST_SAVE_S
    eval_s: float = 0.0

    def as_state(self) -> dict[str, float]:
        """Plain values for a checkpoint."""
        state = {"save_s": self.save_s, "eval_s": self.eval_s}
        return state | ({"step_s": self.step_s} if self.step_s is not None else {})

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> "Estimates":
        """Estimates saved by `as_state` (defaults for what is missing)."""
        return cls(state.get("step_s"), state.get("save_s", FIRST_SAVE_S), state.get("eval_s", 0))


@dataclass
class TimeLimit:
    """A rank's side of the time-limit watch: asks rank 0's plan at the agreed steps.

    `deadline`: time.monotonic() by which the job must have checkpointed (rank 0's; None
    elsewhere, or without a limit); `limit_at`: when the limit itself comes. `active`:
    whether the ranks look at all (the same on every rank). Rank 0 records measurements in
    `estimates`.
    """

    ctx: DistContext
    active: bool
    margin_s: float
    deadline: float | None = None
    limit_at: float | None = None
    estimates: Estimates = field(default_factory=Estimates)
    stop_at: int = -1
    next_check: int = 0
    epoch_end: int = 0
    _last: tuple[int, float] | None = None

    @classmethod
    def for_job(cls, ctx: DistContext, signal_delay_s: float, margin_s: float) -> "TimeLimit":
        """The watch of this attempt: active under a readable limit (rank 0 reads it)."""
        active = has_time_limit()
        limit = cls(ctx, active, margin_s)
        if active and ctx.is_main:
            left = seconds_left()
            if left is not None:
                limit.limit_at = time.monotonic() + left
                limit.deadline = limit.limit_at - margin_s
                hold_limit_signal(limit, signal_delay(signal_delay_s))
        return limit

    def remaining_s(self) -> float | None:
        """Seconds left before the job must have checkpointed (rank 0), else None."""
        return None if self.deadline is None else self.deadline - time.monotonic()

    def until_limit_s(self) -> float | None:
        """Seconds left before the time limit itself (rank 0), else None."""
        return None if self.limit_at is None else self.limit_at - time.monotonic()

    def start_epoch(self, first_step: int, steps: int) -> None:
        """The loop goes on at `first_step`, `steps` steps before the next validation,
        checkpoint or epoch end: look first, unless `first_step` is inside the stretch the
        watch already planned (only a log came between: the plan, the next look and the step
        time measured so far go on, with no look, collective or device sync per log)."""
        if first_step < self.epoch_end and first_step + steps == self.epoch_end:
            return
        self.epoch_end, self.next_check, self.stop_at = first_step + steps, first_step, -1
        self._last = None  # validation came between: no step time across the boundary

    def should_stop(self, step: int) -> bool:
        """Whether the job stops before `step` (a step boundary with a batch left); every rank
        calls this at the same steps, and all take part in a look when one is due."""
        if not self.active:
            return False
        if step == self.next_check:
            self._look(step)
        return step == self.stop_at

    def _look(self, step: int) -> None:
        decided = torch.zeros(2, dtype=torch.int64, device=self.ctx.device)
        if self.ctx.is_main:
            stop_in, check_in = self._plan(step)
            decided[0] = -1 if stop_in is None else step + stop_in
            decided[1] = step + check_in
        if self.ctx.world_size > 1:
            dist.broadcast(decided, src=0)
        self.stop_at, self.next_check = (int(v) for v in decided.tolist())

    def _plan(self, step: int) -> tuple[int | None, int]:
        if self.ctx.device.type == "cuda":
            torch.cuda.synchronize(self.ctx.device)  # steps queued are steps not yet done
        now = time.monotonic()
        # A step time carried from an earlier attempt or epoch may be another world's (a run
        # continued on fewer ranks takes several micro-batches a step) or another node's:
        # the first look of an epoch plans with it, and looks again after one step measured.
        carried = self._last is None
        if self._last is not None and step > self._last[0]:
            self.estimates.step_s = (now - self._last[1]) / (step - self._last[0])
        self._last = (step, now)
        left = self.remaining_s()
        if left is None:  # no limit known: no more looks this epoch
            return None, max(self.epoch_end - step, 1)
        est = self.estimates
        decided = plan(left, self.epoch_end - step, est.step_s, est.save_s, est.eval_s)
        return decided.stop_in, 1 if carried else decided.check_in


def time_text(seconds: float) -> str:
    """'2m10s', '45s', '1h03m' for a log line."""
    seconds = max(int(seconds), 0)
    if seconds >= 3600:
        return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"
    if seconds >= 60:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds}s"


def requeue_now(is_main: bool) -> NoReturn:
    """Requeue through submitit's own path: rank 0 sends itself the requeue signal (submitit
    calls the job's `checkpoint`, requeues and exits); other ranks wait to be ended with the
    attempt. Never returns."""
    from trainflow.tasks.train.limits.early_signal import preemption_signal

    if is_main:
        _requeueing.set()  # the job's own signal: not held (hold_limit_signal)
        os.kill(os.getpid(), preemption_signal())
    while True:  # the handler exits this process (rank 0); Slurm or the guard ends the others
        time.sleep(0.5)


@dataclass
class EpochLimit:
    """The loop's view of the watch for one epoch (tasks.train.loop.EpochStop)."""

    limit: TimeLimit
    carried: list[float]
    """Sums of the epoch's batches done by an earlier attempt (all ranks')."""
    done: int = 0
    """Steps done when the loop ended (fewer than it was given: stopped early)."""
    totals: list[float] = field(default_factory=list)
    """The all-rank sums then, the carried ones included (count last)."""

    def should_stop(self, step: int) -> bool:
        """Whether to stop before `step`."""
        return self.limit.should_stop(step)

    def stopped(self, done: int, totals: list[float]) -> None:
        """The loop ended after `done` steps, with these all-rank sums."""
        self.done, self.totals = done, totals


def hold_limit_signal(limit: TimeLimit, delay_s: float) -> None:
    """In rank 0's main thread: hold a time limit's requeue signal until just before the limit.

    The handler in place (submitit's, which checkpoints and requeues at once) stays the one
    that acts: a signal that comes while the limit is near but more than `LAST_S` (at most
    half the job's margin) ahead is re-sent then (the job has normally checkpointed and
    requeued itself by its deadline, the limit less its margin); any other signal (a
    preemption, the job's own, one at the last moment) goes to that handler at once. The
    first signal that reaches it requeues the attempt; any later one is dropped.
    """
    from trainflow.tasks.train.limits.early_signal import preemption_signal

    sig = preemption_signal()
    acting = signal.getsignal(sig)
    if not callable(acting):
        return
    last = min(LAST_S, limit.margin_s / 2)

    def holding(signum: int, frame: FrameType | None) -> None:
        if _acted.is_set():  # this attempt is being requeued already
            return
        until_limit = limit.until_limit_s()
        if (
            not _requeueing.is_set()
            and until_limit is not None
            and last + 0.5 < until_limit <= delay_s + SIGNAL_EARLY_S
        ):
            say(
                f"time limit in {time_text(until_limit)}: requeue signal held for "
                f"{time_text(until_limit - last)}, until the planned checkpoint"
            )
            timer = threading.Timer(until_limit - last, os.kill, (os.getpid(), signum))
            timer.daemon = True
            timer.start()
            return
        _acted.set()
        acting(signum, frame)

    signal.signal(sig, holding)
