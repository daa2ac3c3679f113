"""How a trainflow process sets Python's garbage collector: fewer collections while it starts,
none of its objects collected at its exit.

Python 3.11 collects its youngest generation every 700 allocations not yet freed, and the older
ones every 10 collections of the one below. A process that imports torch, MLflow and Prefect
creates millions of long-lived objects, and those collections walk them again and again for
no garbage (docs/performance.md, P8 profile). At its exit the interpreter collects again as it
tears the modules down: seconds of CPU for memory the OS frees anyway.
"""

import gc

THRESHOLDS = (10_000, 10, 10)
"""gc.set_threshold's (youngest, middle, oldest) for trainflow's processes: the youngest
generation collected every 10,000 allocations instead of 700; the older ones as Python sets
them."""


def at_start() -> None:
    """Collect less often (THRESHOLDS): first thing in the command and in a rank."""
    gc.set_threshold(*THRESHOLDS)


def before_exit() -> None:
    """Leave every object alive now out of any later collection (gc.freeze), the one at the
    interpreter's teardown included. atexit handlers (Prefect's server stop, logging's flush,
    weakref finalizers) still run after this, and so does every release by reference count."""
    gc.freeze()
