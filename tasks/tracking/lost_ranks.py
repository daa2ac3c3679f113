"""What a stage's MLflow run records about ranks its job lost (cluster.lost_ranks)."""

from collections.abc import Callable

from mlflow.tracking import MlflowClient

from trainflow.cluster.lost_ranks import RankLostError
from trainflow.tasks.tracking.runs import set_tags

# MLflow caps tag values at 5000 characters (8000 on newer servers): keep the headline only.
_MAX_TAG = 1000


def record_lost_ranks(
    tracking_uri: str | None,
    run_id: str | None,
    err: RankLostError,
    attempt: int,
    log: Callable[[str], None],
) -> None:
    """Log the loss to `log` and tag the run: `lost_ranks.<attempt>` (which rank, node, how, log)
    and `lost_nodes`. Never raises: the job's own error matters more."""
    headline = str(err).splitlines()[0]
    log(headline)
    if not (tracking_uri and run_id):
        return
    tags = {f"lost_ranks.{attempt}": headline[:_MAX_TAG], "lost_nodes": ",".join(err.nodes)}
    try:
        set_tags(MlflowClient(tracking_uri), run_id, tags)
    except Exception as exc:
        log(f"could not tag run {run_id} with the lost ranks: {type(exc).__name__}: {exc}")
