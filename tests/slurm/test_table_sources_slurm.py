"""A Parquet file of text and a tokenizer folder on the 2-node dev Slurm: the dask workers are
Slurm jobs (they tokenize the row groups), training runs one rank on each node; the same
checks as on the local executor (tests/integration/test_table_sources.py)."""

from pathlib import Path

from mlflow.tracking import MlflowClient

from tests.integration.test_table_sources import train_on_parquet_text

ON_SLURM = [
    "cluster.executor=slurm",
    "cluster.nodes=2",
    "cluster.ranks_per_node=1",
    "cluster.dask.executor=slurm",
    "cluster.dask.n_workers=2",
    "cluster.dask.mem_gb=1",
]


def test_a_language_model_trains_on_parquet_text_on_two_slurm_nodes(tmp_path: Path) -> None:
    summary = train_on_parquet_text(tmp_path, ON_SLURM)
    client = MlflowClient(summary.tracking_uri)
    parent = client.get_run(summary.parent_run_id)
    (train,) = client.search_runs(
        [parent.info.experiment_id],
        f"tags.mlflow.parentRunId = '{summary.parent_run_id}' and tags.stage = 'train'",
    )
    assert train.data.tags["slurm_node_list"] == "tfnode[1-2]", train.data.tags
    assert train.data.tags["slurm_state"] == "COMPLETED", train.data.tags
