"""Linux process controls (prctl) shared by the processes trainflow forks or starts."""

import ctypes
import signal

_PR_SET_PDEATHSIG = 1
_PR_SET_NAME = 15


def die_with_parent(sig: signal.Signals) -> None:
    """Have the kernel send this process `sig` when its parent dies (SIGKILL included), so no
    process of a run outlives the process that started it."""
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, sig, 0, 0, 0)


def name_process(name: bytes) -> None:
    """Set this process's name (/proc/<pid>/comm, what `ps -e` and psutil's name() show)."""
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_NAME, ctypes.c_char_p(name), 0, 0, 0)
