"""Imports a rank needs later, started at once on a background thread.

torch._dynamo is imported by the first optimizer's `add_param_group` (every torch.optim
optimizer: fused, foreach or per-parameter alike) and by DistributedDataParallel's constructor:
1.2 s on the 2-core CPU machine, 4.6 s on the H100 machine. A rank reaches those calls only
after the process-group rendezvous (waiting for the slowest rank to start) and after loading
its data and building its model; importing dynamo on a thread from the job's first line lets
it run in those waits instead of after them. MLflow is not imported here: rank 0's logger
imports it on the main thread during those waits, and two threads importing parts of MLflow (a
package with import cycles) at once can find a module half initialised (seen: "cannot import
name 'Run' from partially initialized module 'mlflow.entities'").
"""

import threading

from trainflow.tasks.prewarm import prewarm_imports

DYNAMO = "torch._dynamo"


def prewarm_rank() -> threading.Thread:
    """Start this rank's late import of torch._dynamo on a daemon thread."""
    return prewarm_imports((DYNAMO,))
