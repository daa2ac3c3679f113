"""Requeue a Slurm job from inside it without dying of the requeue's own SIGTERM.

Before a time limit or a preemption Slurm sends SIGUSR2; submitit's handler in rank 0
checkpoints the job and runs `scontrol requeue <job id>`. Slurm carries the requeue out by
sending SIGTERM to every process of the job's steps, and scontrol is one of them: it runs in
rank 0's step. On a busy node that SIGTERM can reach scontrol before it has exited, after the
requeue was accepted; submitit's `check_call` then raises `CalledProcessError(... died with
SIGTERM)`, that error becomes rank 0's result, and the flow reports a failed job that Slurm has
in fact requeued.

Here scontrol starts with SIGTERM ignored (an ignored signal stays ignored across exec), so it
finishes its request and exits with its own status; scontrol's real failures still raise, and
Slurm's SIGKILL after KillWait still ends it. `install()` has submitit requeue this way in a
rank's process (cluster.rank_main; the replacement itself lives in trainflow.compat).
"""

import signal
import subprocess
from collections.abc import Sequence

REQUEUE_TIMEOUT_S = 60.0
"""As submitit's own requeue: how long scontrol may take before it is killed."""


def call_ignoring_sigterm(argv: Sequence[str], timeout_s: float) -> None:
    """Run `argv` with SIGTERM ignored in it; CalledProcessError unless it exits 0.

    Call from the main thread (a signal handler runs there): the disposition is process-wide
    and is set back as soon as the child has started."""
    previous = signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        child = subprocess.Popen(list(argv))
    finally:
        signal.signal(signal.SIGTERM, previous)
    try:
        returncode = child.wait(timeout=timeout_s)
    except BaseException:
        child.kill()
        child.wait()
        raise
    if returncode != 0:
        raise subprocess.CalledProcessError(returncode, list(argv))


def requeue_job(job_id: str) -> None:
    """`scontrol requeue <job_id>`, shielded from the requeue's own SIGTERM."""
    call_ignoring_sigterm(["scontrol", "requeue", job_id], REQUEUE_TIMEOUT_S)


def install() -> None:
    """Requeue through `requeue_job` in this process (a rank's)."""
    from trainflow.compat import shield_submitit_requeue

    shield_submitit_requeue(requeue_job)
