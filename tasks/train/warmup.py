"""Imports a rank needs later, started at once on a background thread.

torch._dynamo is imported by the first optimizer's `add_param_group` (every torch.optim
optimizer: fused, foreach or per-parameter alike) and by DistributedDataParallel's constructor:
1.2 s on the 2-core CPU machine, 4.6 s on the H100 machine. A rank reaches those calls only
after the process-group rendezvous (waiting for the slowest rank to start) and after loading
its data and building its model; importing dynamo on a thread from the job's first line lets
it run in those waits instead of after them. Rank 0 also needs MLflow's client for its logger.
"""

import os
import threading

import submitit

from tasks.prewarm import prewarm_imports

DYNAMO = "torch._dynamo"
MLFLOW = "mlflow.tracking"


def rank_modules(logs_metrics: bool, rank: int) -> tuple[str, ...]:
    """What a rank imports late: dynamo always, MLflow's client on rank 0 when the job logs."""
    return (DYNAMO, MLFLOW) if logs_metrics and rank == 0 else (DYNAMO,)


def prewarm_rank(logs_metrics: bool) -> threading.Thread:
    """Start this rank's late imports (the rank from submitit's environment, else $RANK)."""
    try:
        rank = submitit.JobEnvironment().global_rank
    except RuntimeError:  # not a submitit job: torchrun's variables or a single process
        rank = int(os.environ.get("RANK", "0"))
    return prewarm_imports(rank_modules(logs_metrics, rank))
