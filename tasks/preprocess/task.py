"""Prefect entry of the preprocessing stage: thin, cached on content.

The cache key is the raw data's fingerprint plus the preprocessing config. A cached result
is only reused while its dataset folder still holds a valid manifest: a deleted or damaged
dataset gets a fresh key and is rebuilt.
"""

import hashlib
import uuid
from pathlib import Path
from typing import Any

from prefect import task
from prefect.context import TaskRunContext

from cluster.config import DaskConfig
from cluster.dask import dask_client
from tasks.errors import DataError
from tasks.preprocess.config import PreprocessConfig
from tasks.preprocess.dataset import dataset_dir, read_manifest
from tasks.preprocess.ref import DatasetRef
from tasks.preprocess.run import run_preprocess
from tasks.preprocess.sources import fingerprint


def dataset_key(cfg: PreprocessConfig) -> str:
    """Content key of a dataset: raw-data fingerprint + preprocessing config."""
    digest = hashlib.sha256(fingerprint(cfg).encode())
    digest.update(cfg.model_dump_json().encode())
    return digest.hexdigest()


def _cache_key(context: TaskRunContext, parameters: dict[str, Any]) -> str:
    key: str = parameters["cache_key"]
    try:
        read_manifest(dataset_dir(Path(parameters["out_root"]), key))
    except DataError:
        return f"preprocess-{key}-{uuid.uuid4().hex}"
    return f"preprocess-{key}"


@task(name="preprocess", cache_key_fn=_cache_key, persist_result=True)
def preprocess_task(
    cfg: PreprocessConfig, dask: DaskConfig, out_root: Path, cache_key: str
) -> DatasetRef:
    """Validate, split, normalise and shard the raw data on a dask cluster."""
    with dask_client(dask) as (client, backend):
        return run_preprocess(cfg, out_root, client, backend, cache_key)
