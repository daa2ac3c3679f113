"""Fixtures shared by the unit tests: a real local dask cluster (never mocked)."""

from collections.abc import Iterator

import distributed
import pytest
import torch

from trainflow.cluster.config import DaskConfig
from trainflow.cluster.dask import Backend, dask_client


@pytest.fixture(scope="module")
def dask_cpu() -> Iterator[tuple[distributed.Client, Backend]]:
    """A 2-worker CPU LocalCluster and its client, shared by one test module."""
    with dask_client(DaskConfig(backend="cpu", n_workers=2)) as (client, backend):
        yield client, backend


@pytest.fixture(autouse=True)
def _restore_torch_threads() -> Iterator[None]:
    """Training code sets torch's thread count for its process: give it back after a test."""
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)
