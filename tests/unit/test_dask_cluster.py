"""The dask cluster factory, with real local clusters."""

import importlib.util
import logging
import os
import re
import sys
import warnings
from pathlib import Path

import distributed
import numpy as np
import pytest

from trainflow.cluster.config import DaskConfig
from trainflow.cluster.dask import (
    THREADS_BELOW,
    array_module,
    dask_client,
    local_kind,
    to_numpy,
    workers_line,
)
from trainflow.cluster.dask_snapshot import register_snapshot
from trainflow.errors import ConfigError
from trainflow.tasks.preprocess.config import PreprocessConfig
from trainflow.tasks.preprocess.size import array_bytes, dataset_bytes


def _gpu_usable() -> bool:
    if importlib.util.find_spec("cupy") is None:
        return False
    try:
        cupy = importlib.import_module("cupy")
        return bool(cupy.cuda.runtime.getDeviceCount() > 0)
    except Exception:
        return False


no_gpu = pytest.mark.skipif(_gpu_usable(), reason="a GPU is usable here")


@pytest.mark.services
def test_cpu_cluster_runs_work_and_closes() -> None:
    before = dict(os.environ)
    with dask_client(DaskConfig(backend="cpu", n_workers=2)) as (client, backend):
        cluster = client.cluster
        assert backend == "numpy"
        assert len(client.scheduler_info()["workers"]) == 2
        assert client.submit(np.sum, np.arange(10)).result() == 45
        # The nannies set their workers' settings in this process's environment...
        assert os.environ.get("MALLOC_TRIM_THRESHOLD_") == str(64 << 20)
    assert client.status == "closed"
    assert cluster is not None and cluster.status.name == "closed"
    # ...which processes the flow starts later must not inherit (OMP_NUM_THREADS=1 ...).
    assert dict(os.environ) == before


def test_auto_runs_a_small_dataset_on_threads_and_a_large_or_unknown_one_on_processes() -> None:
    auto = DaskConfig()
    assert local_kind(auto, 1 << 20) == "threads"  # the tiny and demo presets
    assert local_kind(auto, THREADS_BELOW) == "processes"
    assert local_kind(auto, None) == "processes"  # files whose decoded size is unknown
    # A memory limit per worker is only kept by worker processes.
    assert local_kind(DaskConfig(memory_limit="2GB"), 1 << 20) == "processes"
    assert local_kind(DaskConfig(local_workers="processes"), 1 << 20) == "processes"
    assert local_kind(DaskConfig(local_workers="threads"), 1 << 40) == "threads"


def test_only_array_sources_give_the_size_that_picks_threads(tmp_path: Path) -> None:
    (tmp_path / "imgs" / "cat").mkdir(parents=True)
    (tmp_path / "imgs" / "cat" / "a.png").write_bytes(b"\x89PNG" + bytes(60))
    np.savez(tmp_path / "a.npz", images=np.zeros((4, 2, 2), np.uint8), labels=np.arange(4))
    assert array_bytes(PreprocessConfig(source="synthetic", synthetic_samples=10)) is not None
    assert array_bytes(PreprocessConfig(source="mnist")) == dataset_bytes(PreprocessConfig())
    assert array_bytes(PreprocessConfig(source="npz", path=tmp_path / "a.npz")) is not None
    # Compressed images decode to more than their files; a plug-in's code stays in processes.
    assert array_bytes(PreprocessConfig(source="folder", path=tmp_path / "imgs")) is None
    assert array_bytes(PreprocessConfig(source="user_sources:Reader")) is None


def test_a_threads_cluster_works_in_this_process_and_leaves_its_path_as_it_was(
    tmp_path: Path,
) -> None:
    snapshot = tmp_path / "snapshot"
    snapshot.mkdir()
    (snapshot / "user_mod_in_thread.py").write_text("WHERE = 'snapshot'\n")
    path_before, env_before = list(sys.path), dict(os.environ)
    cfg = DaskConfig(backend="cpu", n_workers=2, threads_per_worker=2)
    with dask_client(cfg, dataset_bytes=1 << 20) as (client, backend):
        assert backend == "numpy"
        assert workers_line(client) == "4 threads in this process"
        assert client.submit(os.getpid, pure=False).result() == os.getpid()
        # The run's code snapshot comes first for the workers, which are this process here.
        register_snapshot(client, [snapshot])
        where = client.submit(importlib.import_module, "user_mod_in_thread").result().WHERE
        assert where == "snapshot" and sys.path[0] == str(snapshot)
    assert client.status == "closed"
    assert sys.path == path_before and dict(os.environ) == env_before
    sys.modules.pop("user_mod_in_thread", None)


def test_two_threads_clusters_at_once_start_without_a_warning() -> None:
    # A second run on the machine: dask's default HTTP port (:8787) would be taken already.
    cfg = DaskConfig(backend="cpu")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with (
            dask_client(cfg, dataset_bytes=1 << 10) as (a, _),
            dask_client(cfg, dataset_bytes=1 << 10) as (b, _),
        ):
            assert workers_line(a) == workers_line(b) == "2 threads in this process"


@pytest.mark.services
def test_a_large_dataset_gets_worker_processes() -> None:
    cfg = DaskConfig(backend="cpu", n_workers=2)
    with dask_client(cfg, dataset_bytes=THREADS_BELOW) as (client, _):
        assert workers_line(client).startswith("2 worker processes, 2 threads, http")
        assert client.submit(os.getpid, pure=False).result() != os.getpid()


def test_threads_are_refused_for_workers_elsewhere() -> None:
    with pytest.raises(ValueError, match="local_workers='threads' runs a local cluster"):
        DaskConfig(local_workers="threads", address="tcp://127.0.0.1:8786")
    with pytest.raises(ValueError, match=re.escape("cluster.dask.executor='slurm'")):
        DaskConfig(local_workers="threads", executor="slurm")


@pytest.mark.services
def test_cluster_closes_when_the_body_fails() -> None:
    cfg = DaskConfig(backend="cpu", n_workers=1)
    with pytest.raises(RuntimeError, match="boom"), dask_client(cfg) as (client, _):
        cluster = client.cluster
        raise RuntimeError("boom")
    assert client.status == "closed"
    assert cluster is not None and cluster.status.name == "closed"


@pytest.mark.services
@no_gpu
def test_auto_falls_back_to_cpu_without_gpu() -> None:
    with dask_client(DaskConfig(backend="auto", n_workers=1)) as (client, backend):
        assert backend == "numpy"
        assert isinstance(client.cluster, distributed.LocalCluster)


@no_gpu
def test_gpu_backend_without_gpu_is_a_config_error() -> None:
    message = "backend='gpu' but no GPU cluster could start"
    with pytest.raises(ConfigError, match=message), dask_client(DaskConfig(backend="gpu")):
        pass


@pytest.mark.services
def test_existing_scheduler_is_used_and_left_running() -> None:
    with distributed.LocalCluster(
        n_workers=1, processes=True, host="127.0.0.1", dashboard_address=":0"
    ) as external:
        cfg = DaskConfig(address=external.scheduler_address, backend="cpu")
        with dask_client(cfg) as (client, backend):
            assert backend == "numpy"
            assert client.scheduler_info()["address"] == external.scheduler_address
            assert client.submit(lambda: 7).result() == 7
        assert client.status == "closed"
        with distributed.Client(external) as again:
            assert again.submit(lambda: 8).result() == 8


def _dask_info(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [
        f"{r.name}: {r.getMessage()}"
        for r in caplog.records
        if r.name.split(".")[0] in ("distributed", "dask_cuda") and r.levelno < logging.WARNING
    ]


@pytest.fixture
def prefect_like_logging(monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """The "distributed" logger as a flow process has it once Prefect configured logging: no
    handler of its own, propagating to the root, where Prefect's console handler (here caplog's)
    sits."""
    logger = logging.getLogger("distributed")
    monkeypatch.setattr(logger, "handlers", [])
    monkeypatch.setattr(logger, "propagate", True)
    caplog.set_level(logging.DEBUG)


@pytest.mark.services
@pytest.mark.usefixtures("prefect_like_logging")
def test_no_dask_info_lines_reach_the_log(caplog: pytest.LogCaptureFixture) -> None:
    with dask_client(DaskConfig(backend="cpu", n_workers=1)) as (client, _):
        assert client.submit(lambda: 1).result() == 1
    assert _dask_info(caplog) == []
    assert logging.getLogger("distributed").level == logging.INFO  # restored after


@pytest.mark.services
@pytest.mark.usefixtures("prefect_like_logging")
def test_no_dask_info_lines_with_an_existing_scheduler(caplog: pytest.LogCaptureFixture) -> None:
    with distributed.LocalCluster(
        n_workers=1, processes=True, host="127.0.0.1", dashboard_address=":0"
    ) as external:
        caplog.clear()
        with dask_client(DaskConfig(address=external.scheduler_address, backend="cpu")) as (c, _):
            assert c.submit(lambda: 2).result() == 2
        assert _dask_info(caplog) == []


def test_array_helpers() -> None:
    assert array_module("numpy") is np
    with pytest.raises(ValueError, match="unknown array backend"):
        array_module("torch")
    out = to_numpy([1, 2, 3])
    assert isinstance(out, np.ndarray) and out.tolist() == [1, 2, 3]


def _heartbeat_lost(dask_worker: object) -> None:
    """What distributed.worker.Worker.heartbeat logs when the scheduler's comm is gone."""
    try:
        raise OSError("Stream is closed")
    except OSError:
        logging.getLogger("distributed.worker").exception(
            "Failed to communicate with scheduler during heartbeat."
        )
    logging.getLogger("distributed.worker").warning("another worker warning")


@pytest.mark.services
@pytest.mark.parametrize("debug", [False, True])
def test_a_lost_heartbeat_shows_its_traceback_only_with_debug(
    debug: bool, capfd: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The teardown race of a failed stage (a worker's heartbeat in flight as the scheduler
    closes) printed 25 lines of traceback after the user's one error line; real worker
    processes, whose stderr is this process's."""
    if debug:
        monkeypatch.setenv("TRAINFLOW_DEBUG", "1")
    else:
        monkeypatch.delenv("TRAINFLOW_DEBUG", raising=False)
    with dask_client(DaskConfig(backend="cpu", n_workers=1)) as (client, _):
        client.run(_heartbeat_lost)
    err = capfd.readouterr().err
    assert "another worker warning" in err  # the worker's other records still show
    assert ("Traceback" in err) is debug, err
    assert ("Failed to communicate with scheduler" in err) is debug, err
