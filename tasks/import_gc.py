"""Python's cyclic garbage collector paused while a process imports its libraries.

Importing torch, Prefect or MLflow creates millions of objects that all stay alive (modules,
functions, classes). The collector runs after every 700 new container objects and now and
then over all older ones, so during an import it traverses the same live objects again and
again and frees nothing. Paused, the same imports took 15-25% less CPU on the 2-core machine
(`python -c` with and without `gc.disable()`, three runs each): what a rank imports
(trainflow.tasks.train.job, torch with it) 1.8 -> 1.5 CPU s, with torch._dynamo 3.1 -> 2.5, the
flow's pipeline module 4.5 -> 3.7.

`imports_without_gc()` pauses it for a block; pauses on several threads (a background import
beside the main thread's) nest, and the collector comes back when the last one ends, as it was
before the first. A process forked during a pause (a warm server's child, Prefect's held
temporary server) starts with the collector as it was before the pause.

What was imported stays alive for the whole process, yet the collector would still traverse
it: once soon after a pause (a pause leaves everything in the youngest generation, so its first
collection walks all of it), now and then later, and in the interpreter's exit, which
collects everything once more. `freeze_imported()` moves what is alive into the collector's
permanent generation (gc.freeze) at the end of the imports' pause; `freeze_at_exit()` does so
as the process exits. Measured on the 2-core AMD EPYC, two or three runs each: a rank-like
process (torch, torch._dynamo, the job module, 200 AdamW steps) took 2.9-3.3 CPU s with a normal
exit and 2.0-2.1 frozen after its imports, or 2.2-2.5 collected then frozen; ending with
os._exit, as a trained rank does (tasks.train.distributed), 2.1 -> 1.9. pytest's collection of
this suite (its exit runs five full collections): 11.9 -> 6.0 CPU s.
"""

import atexit
import gc
import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager

_lock = threading.Lock()
_pauses = 0
"""How many imports_without_gc blocks are open in this process."""
_resume = False
"""Whether the collector was enabled when the first open block paused it."""


@contextmanager
def imports_without_gc() -> Iterator[None]:
    """Run the block with the cyclic garbage collector paused (see the module docstring)."""
    global _pauses, _resume
    with _lock:
        if _pauses == 0:
            _resume = gc.isenabled()
            gc.disable()
        _pauses += 1
    try:
        yield
    finally:
        with _lock:
            if _pauses > 0:  # 0: a forked child, where _after_fork_in_child reset it
                _pauses -= 1
                if _pauses == 0 and _resume:
                    gc.enable()


def _after_fork_in_child() -> None:
    """A child forked during a pause runs with none open: the collector as before it."""
    global _lock, _pauses
    _lock = threading.Lock()  # another thread may have held it at the fork
    if _pauses > 0:
        _pauses = 0
        if _resume:
            gc.enable()


os.register_at_fork(after_in_child=_after_fork_in_child)


def freeze_imported(collect: bool = False) -> None:
    """Move every object alive now into the collector's permanent generation, never traversed
    again: call it at the end of the imports' pause, inside it (the collector's counts ran on
    through the pause: its first allocation after would start a collection of everything),
    before the process holds data of its own. With `collect`, collect first (a full collection:
    ~0.4 CPU s for torch, Prefect and MLflow) where the process may already have run code whose
    cyclic garbage would otherwise stay for good (a user's model built to check it). Without,
    the imports' own garbage stays (11 MB in ~14,500 objects after torch, Prefect, MLflow and
    the pipeline, measured)."""
    if collect:
        gc.collect()
    gc.freeze()


def freeze_at_exit() -> None:
    """Freeze everything as the process exits normally (after every atexit callback registered
    later, which run first): the interpreter's own last collections then traverse nothing.
    Nothing is leaked by it: the process is ending."""
    atexit.register(gc.freeze)
