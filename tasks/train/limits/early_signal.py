"""A preemption signal that reaches a rank while it is still starting is held, not fatal.

Slurm sends the requeue signal (USR2) `signal_delay_s` before the time limit, or at once on
preemption. submitit installs its handler only after it has unpickled the job, which imports
torch and the training code: seconds on a loaded node. A signal in that window used to kill
every rank ("srun: error: tasks 0-1: User defined signal 2") and fail the job instead of
requeueing it. Importing `tasks.train` (the first thing that unpickling does) installs a
handler that only remembers the signal; the job re-sends it to itself once submitit's own
handler is in place, and the usual checkpoint-and-requeue follows.

Nothing here imports torch: it must run before the heavy imports.
"""

import os
import signal
import sys
from types import FrameType

_held: list[int] = []


TASK_MAINS = ("trainflow.cluster.rank_main", "submitit.core._submit")
"""The `python -m` entries of a process submitit starts to run a task: ours (what the rank
guard starts), and submitit's own."""


def in_submitit_task() -> bool:
    """True only in a process submitit started to run a task (never a flow or a test)."""
    main = getattr(sys.modules.get("__main__"), "__spec__", None)
    return getattr(main, "name", None) in TASK_MAINS


def preemption_signal() -> signal.Signals:
    """The signal submitit checkpoints and requeues on (SUBMITIT_PREEMPT_SIGNAL, else USR2)."""
    name = "SIG" + os.environ.get("SUBMITIT_PREEMPT_SIGNAL", "USR2")
    found = getattr(signal, name, signal.SIGUSR2)
    return signal.Signals(found)


def _remember(signum: int, frame: FrameType | None) -> None:
    _held.append(signum)


def hold_early_preemption(force: bool = False) -> None:
    """In a submitit task process (or with `force`), hold the preemption signal until
    `deliver_held_signal` runs, if nothing handles it yet."""
    if not (force or in_submitit_task()):
        return
    sig = preemption_signal()
    if signal.getsignal(sig) == signal.SIG_DFL:
        signal.signal(sig, _remember)


def deliver_held_signal() -> bool:
    """Re-send a held signal to this process, now that a real handler is installed.

    Call at the start of the job, after submitit installed its handler. Returns whether a
    signal was re-sent. If the holder is somehow still the handler, it is removed first, so
    the signal acts as it would have without us.
    """
    if not _held:
        return False
    sig = _held[-1]
    _held.clear()
    if signal.getsignal(sig) is _remember:
        signal.signal(sig, signal.SIG_DFL)
    os.kill(os.getpid(), sig)
    return True
