"""Mark the MLflow runs of a flow process that died KILLED, as its own cleanup would have.

A flow process ends its runs FINISHED, FAILED or KILLED (tasks.tracking.pipeline_runs). Killed
outright it cannot: the job's watchdog (cluster.job_watchdog) cancels the training job and then
runs ``python -m trainflow.tasks.tracking.orphaned_runs <tracking uri> <run id>``, which marks
that run and its parent KILLED where they are still RUNNING (a run that ended keeps its status).
"""

import sys

from trainflow.tasks.tracking.reachability import limit_http_retries, reachable

PARENT_TAG = "mlflow.parentRunId"


def mark_killed(tracking_uri: str, run_id: str) -> list[str]:
    """Mark `run_id` and its parent run KILLED where RUNNING; the ids marked."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri)
    run = client.get_run(run_id)
    ids = [run_id, *([p] if (p := run.data.tags.get(PARENT_TAG)) else [])]
    marked = []
    for rid in ids:
        if client.get_run(rid).info.status == "RUNNING":
            client.set_terminated(rid, status="KILLED")
            marked.append(rid)
    return marked


def command(tracking_uri: str, run_id: str) -> list[str]:
    """The argv that runs `mark_killed` in a fresh interpreter (what a watchdog runs)."""
    return [sys.executable, "-m", "trainflow.tasks.tracking.orphaned_runs", tracking_uri, run_id]


def main(argv: list[str]) -> int:
    uri, run_id = argv
    limit_http_retries()
    if not reachable(uri):
        print(f"MLflow run {run_id} not marked KILLED: {uri} is unreachable", flush=True)
        return 1
    marked = mark_killed(uri, run_id)
    print(f"MLflow runs marked KILLED: {', '.join(marked) or 'none (already ended)'}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
