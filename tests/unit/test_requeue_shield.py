"""Rank 0's `scontrol requeue` outlives the SIGTERM that the requeue itself sends the job
(cluster.requeue). The child processes here are real and really receive SIGTERM, as scontrol
does from slurmd when the requeue is carried out before scontrol has exited; the whole requeue
runs against the real dev Slurm in tests/slurm/test_requeue.py."""

import signal
import subprocess
import sys
from types import FrameType

import pytest

from trainflow.cluster import requeue

# The job's SIGTERM arrives while the child still runs; it then finishes with its own status.
_TERMINATED_THEN = "kill -TERM $$; sleep 0.2; exit {status}"


def test_a_child_terminated_mid_call_is_killed_without_the_shield() -> None:
    """The failure seen in the suite (job 269): what submitit's own check_call makes of it."""
    with pytest.raises(subprocess.CalledProcessError, match=r"died with <Signals\.SIGTERM"):
        subprocess.check_call(["sh", "-c", _TERMINATED_THEN.format(status=0)], timeout=30)


def test_the_shield_lets_the_child_finish_with_its_own_status() -> None:
    requeue.call_ignoring_sigterm(["sh", "-c", _TERMINATED_THEN.format(status=0)], 30)
    with pytest.raises(subprocess.CalledProcessError) as failed:  # scontrol's own errors
        requeue.call_ignoring_sigterm(["sh", "-c", _TERMINATED_THEN.format(status=3)], 30)
    assert failed.value.returncode == 3


def test_the_caller_keeps_its_own_sigterm_handler() -> None:
    seen: list[int] = []

    def handler(signum: int, frame: FrameType | None) -> None:
        seen.append(signum)

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        requeue.call_ignoring_sigterm([sys.executable, "-c", "pass"], 30)
        assert signal.getsignal(signal.SIGTERM) is handler
        signal.raise_signal(signal.SIGTERM)
        assert seen == [signal.SIGTERM]
    finally:
        signal.signal(signal.SIGTERM, previous)


def test_a_child_past_its_timeout_is_killed() -> None:
    with pytest.raises(subprocess.TimeoutExpired):
        requeue.call_ignoring_sigterm(["sleep", "30"], 0.5)
