"""Prefect entry of the preprocessing stage: thin, cached on content.

The cache key is the raw data's fingerprint plus the preprocessing config (and the output
folder).
"""

import hashlib
from pathlib import Path
from typing import Any

from prefect import get_run_logger, task
from prefect.context import TaskRunContext

from trainflow.cluster.config import DaskConfig
from trainflow.errors import DataError
from trainflow.tasks.diskspace import disk_stage
from trainflow.tasks.prefect_progress import TaskProgress
from trainflow.tasks.preprocess.config import PreprocessConfig
from trainflow.tasks.preprocess.dataset import dataset_dir, read_manifest
from trainflow.tasks.preprocess.ref import DatasetRef
from trainflow.tasks.preprocess.size import array_bytes, dataset_bytes
from trainflow.tasks.preprocess.sources import fingerprint

LAYOUT = "layout 2: a shard's rows in source order"
"""Part of every dataset's key, changed whenever the same inputs and config give other shards:
a dataset an earlier layout cached is rebuilt, so one config trains the same on every machine
whatever its cache holds. Layout 2: the rows inside a shard in source order
(run.split_indices)."""


def dataset_key(cfg: PreprocessConfig) -> str:
    """Content key of a dataset: raw-data fingerprint + shard layout + preprocessing config."""
    digest = hashlib.sha256(fingerprint(cfg).encode())
    digest.update(LAYOUT.encode())
    digest.update(cfg.model_dump_json().encode())
    return digest.hexdigest()


def _cache_key(context: TaskRunContext, parameters: dict[str, Any]) -> str:
    folder = dataset_dir(Path(parameters["out_root"]), parameters["cache_key"]).resolve()
    # The folder is part of the key: a cached ref must point into this workdir's datasets.
    return f"preprocess-{parameters['cache_key']}-{hashlib.sha256(bytes(folder)).hexdigest()[:16]}"


def _dataset_ready(out_root: Path, key: str) -> bool:
    try:
        read_manifest(dataset_dir(out_root, key))
    except DataError:
        return False
    return True


@task(name="preprocess", cache_key_fn=_cache_key, persist_result=True)
def preprocess_task(
    cfg: PreprocessConfig,
    dask: DaskConfig,
    out_root: Path,
    cache_key: str,
    code: list[Path] | None = None,
) -> DatasetRef:
    """Validate, split, normalise and shard the raw data on a dask cluster (whose workers
    import the user's code from the run's snapshot folders `code` first)."""
    # dask's distributed (~0.2 s to import) only where the cache did not serve the dataset.
    from trainflow.cluster.dask import dask_client, workers_line
    from trainflow.cluster.dask_slurm import worker_placement
    from trainflow.cluster.dask_snapshot import register_snapshot
    from trainflow.tasks.preprocess.run import run_preprocess

    log = get_run_logger()
    size = array_bytes(cfg)  # a small array dataset is preprocessed by threads of this process
    # out_root is workdir/datasets: the cluster's logs and job records go to the workdir.
    with dask_client(dask, out_root.parent, size) as (client, backend):
        register_snapshot(client, code or [])
        log.info(
            "preprocessing source=%s on dask (%s backend, %s)",
            cfg.source,
            backend,
            workers_line(client),
        )
        if dask.executor != "local":
            log.info("dask workers (Slurm): %s", worker_placement(client))
        progress = TaskProgress(log.warning)
        ref = run_preprocess(cfg, out_root, client, backend, cache_key, progress)
    log.info(
        "dataset %s: %s samples of shape %s, %d classes, hash %s",
        ref.path,
        ref.counts,
        list(ref.shape),
        len(ref.classes),
        ref.content_hash[:16],
    )
    return ref


def preprocess(
    cfg: PreprocessConfig, dask: DaskConfig, out_root: Path, code: list[Path] | None = None
) -> tuple[DatasetRef, bool]:
    """Run the cached task; returns the dataset and whether the cache served it.

    A cached result is only reused while its dataset folder still holds a valid manifest:
    a deleted or damaged dataset refreshes the cache entry and is rebuilt.
    """
    key = dataset_key(cfg)
    task_ = preprocess_task.with_options(refresh_cache=not _dataset_ready(out_root, key))
    with disk_stage("preprocess", out_root, dataset_bytes(cfg)):
        state = task_(cfg, dask, out_root, key, code, return_state=True)
        return state.result(), state.name == "Cached"
