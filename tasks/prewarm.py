"""Import modules on a background thread, so the import runs while this process waits.

A module imported here and at the same time by the main thread is imported once: the main
thread waits for it (Python's per-module import lock). But two threads importing different parts
of one package with import cycles (MLflow, torch) can each find the other's module half
initialised ("partially initialized module"), so callers join the thread before their own
thread imports from the same packages.
"""

import importlib
import threading

from trainflow.tasks.import_gc import imports_without_gc

EVALUATE_MODULES = (
    "trainflow.tasks.evaluate.plots",
    "trainflow.tasks.evaluate.model_logging",
    "torch._dynamo",
    "torch.export",
    "torch.export._trace",  # what export() itself imports on its first call: ~1.4 s
)
"""What the evaluate stage imports on first use (figures, the pt2 export, model logging): the
flow imports them while it waits for the training job (3-4 s of the stage on 2 CPU cores)."""


def evaluate_modules() -> tuple[str, ...]:
    """EVALUATE_MODULES, less the model export's when a warm-rank server of this process
    will export the model (tasks.evaluate.warm_export): the figures' modules only."""
    from trainflow.cluster.warm_pool import running_pool

    return EVALUATE_MODULES if running_pool() is None else EVALUATE_MODULES[:1]


def prewarm_imports(modules: tuple[str, ...]) -> threading.Thread:
    """Import `modules` in order on a daemon thread; returns the started thread.

    An import that fails here is left for the main thread to raise where it needs the module.
    """

    def run() -> None:
        with imports_without_gc():  # the whole process's collector, while this thread imports
            for name in modules:
                try:
                    importlib.import_module(name)
                except Exception:  # the main thread's own import reports it, with its context
                    return

    thread = threading.Thread(target=run, name="trainflow-prewarm", daemon=True)
    thread.start()
    return thread
