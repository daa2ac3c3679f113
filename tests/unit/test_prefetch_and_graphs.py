"""The fast path's data side and CUDA-graph settings on CPU: host-to-device prefetch, data
placement, drop-last batches, resume with these settings (tests/gpu runs the CUDA side)."""

from pathlib import Path
from typing import Any

import pytest
import torch
from pydantic import ValidationError

from tests.unit.datasets import write_dataset, write_rgb_dataset
from trainflow.errors import ConfigError
from trainflow.tasks.preprocess.ref import DatasetRef
from trainflow.tasks.spec import image_classification
from trainflow.tasks.train.checkpointing.checkpoint import latest_checkpoint, load_state
from trainflow.tasks.train.config import TrainConfig
from trainflow.tasks.train.data import (
    Placement,
    Split,
    load_split_to,
    place_on_device,
    rank_batches,
    steps_per_epoch,
)
from trainflow.tasks.train.job import TrainingJob, TrainJobSpec
from trainflow.tasks.train.model_plugins import build_model
from trainflow.tasks.train.models import (
    place_model,
    uses_cuda_graphs,
)
from trainflow.tasks.train.prefetch import Prefetcher
from trainflow.tasks.train.recipe import Recipe

CPU = torch.device("cpu")
NHWC = torch.channels_last


# --- data placement and prefetch ----------------------------------------------------------


def _host_split(n: int, channels_last: bool) -> Split:
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(n, 3, 5, 4, generator=gen)
    if channels_last:
        x = x.contiguous(memory_format=NHWC)
    return Split(x, torch.randperm(n, generator=gen))


@pytest.mark.parametrize("channels_last", [False, True])
def test_prefetched_batches_equal_plain_gathers_in_order(channels_last: bool) -> None:
    split = _host_split(53, channels_last)
    indices = rank_batches(split, 8, seed=3, epoch=2, rank=0, world_size=1)
    assert len(indices[-1]) == 5  # a partial last batch goes through the staging too
    # All batches are held at once: none may alias a staging buffer that is refilled later.
    staged = list(Prefetcher(split.x, split.y, CPU, capacity=8)(indices))
    assert len(staged) == len(indices)
    for (x, y), index in zip(staged, indices, strict=True):
        torch.testing.assert_close(x, split.x[index], atol=0, rtol=0)
        assert torch.equal(y, split.y[index])
        assert x.is_contiguous(memory_format=NHWC if channels_last else torch.contiguous_format)


def test_a_prefetcher_is_reusable_across_epochs_and_refuses_oversized_batches() -> None:
    split = _host_split(40, channels_last=False)
    prefetcher = Prefetcher(split.x, split.y, CPU, capacity=16)
    for epoch in (1, 2):
        indices = rank_batches(split, 16, seed=0, epoch=epoch, rank=0, world_size=1)
        got = torch.cat([y for _, y in prefetcher(indices)])
        assert torch.equal(got, split.y[torch.cat(indices)])
    assert list(prefetcher([])) == []
    with pytest.raises(ValueError, match="exceeds the staging capacity 16"):
        list(prefetcher([torch.arange(17)]))


def test_split_batches_on_cpu_are_plain_gathers_with_the_prefetchers_result() -> None:
    split = _host_split(30, channels_last=True)
    indices = rank_batches(split, 7, seed=5, epoch=1, rank=1, world_size=2)
    direct = list(split.batches(indices, CPU))
    staged = list(Prefetcher(split.x, split.y, CPU, capacity=7)(indices))
    assert not split._prefetchers  # the host is the CPU's device: nothing to stage
    for (dx, dy), (sx, sy) in zip(direct, staged, strict=True):
        assert torch.equal(dx, sx) and torch.equal(dy, sy)


@pytest.mark.parametrize("placement", ["auto", "device", "host"])
def test_every_placement_keeps_cpu_data_where_it_is(placement: Placement, tmp_path: Path) -> None:
    ref = write_rgb_dataset(tmp_path / "rgb")
    assert place_on_device(placement, CPU, 10**6)  # on CPU the host is the device
    # ... unless the split is too large for it: auto then streams from the shards.
    assert place_on_device(placement, CPU, 10**15) == (placement != "auto")
    split = load_split_to(ref.path, "train", CPU, channels_last=True, placement=placement)
    assert isinstance(split, Split) and split.x.is_contiguous(memory_format=NHWC)
    assert split.on_host


def test_data_placement_takes_auto_device_or_host() -> None:
    assert TrainConfig().data_placement == "auto"
    with pytest.raises(ValidationError, match="data_placement"):
        TrainConfig(data_placement="gpu")


# --- CUDA graphs settings (the graphs themselves: tests/gpu) ------------------------------


def test_cuda_graphs_with_device_cpu_is_a_config_error() -> None:
    assert TrainConfig().cuda_graphs is False
    with pytest.raises(ValidationError, match=r"cuda_graphs=true needs a GPU.*device=auto"):
        TrainConfig(cuda_graphs=True, device="cpu")


def test_cuda_graphs_apply_only_on_cuda_devices() -> None:
    cfg = TrainConfig(cuda_graphs=True)
    assert uses_cuda_graphs(cfg, torch.device("cuda", 0)) and not uses_cuda_graphs(cfg, CPU)
    assert not uses_cuda_graphs(TrainConfig(), torch.device("cuda", 0))
    model = place_model(build_model(cfg, image_classification((1, 12, 12), 4)), cfg, CPU)
    assert model._compiled_call_impl is None  # not compiled for graphs on a CPU


def test_drop_last_gives_equal_batches_and_floor_steps() -> None:
    split = _host_split(103, channels_last=False)
    kept = rank_batches(split, 16, seed=0, epoch=1, rank=1, world_size=2, drop_last=True)
    assert [len(b) for b in kept] == [16, 16, 16]  # 51 per rank: 3 left over
    assert steps_per_epoch(103, 16, 2, drop_last=True) == 3
    assert steps_per_epoch(103, 16, 2) == 4
    every = rank_batches(split, 16, seed=0, epoch=1, rank=1, world_size=2)
    assert torch.equal(torch.cat(kept), torch.cat(every)[:48])  # same order, tail cut


def _train(dataset: DatasetRef, out: Path, epochs: int, **train: object) -> Path:
    cfg = TrainConfig(epochs=epochs, batch_size=24, precision="fp32", **train)
    TrainingJob(TrainJobSpec(train=cfg, dataset=dataset, out_dir=out))()
    latest = latest_checkpoint(out / "checkpoints")
    assert latest is not None
    return latest


class _Preempted(Exception):
    pass


class _PreemptedAfterEpoch1(Recipe):
    def record(self, *args: Any) -> None:
        super().record(*args)
        if self.progress.epoch == 1:
            raise _Preempted


class _StopsAfterEpoch1(TrainingJob):
    """Dies right after its first checkpoint, as a preempted job does."""

    recipe = _PreemptedAfterEpoch1


@pytest.mark.skipif(torch.cuda.is_available(), reason="tests the CPU fallback")
@pytest.mark.parametrize("placement", ["auto", "host"])
def test_resumed_runs_take_the_same_batches_as_uninterrupted_ones(
    placement: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    dataset = write_dataset(tmp_path / "ds", n_train=100, n_val=32)
    settings = {"cuda_graphs": True, "data_placement": placement}
    whole = load_state(_train(dataset, tmp_path / "whole", 3, **settings))
    cfg = TrainConfig(epochs=3, batch_size=24, precision="fp32", **settings)
    spec = TrainJobSpec(train=cfg, dataset=dataset, out_dir=tmp_path / "resumed")
    with pytest.raises(_Preempted):
        _StopsAfterEpoch1(spec)()
    resumed = load_state(_train(dataset, tmp_path / "resumed", 3, **settings))
    out = capsys.readouterr().out
    assert "warning: train.cuda_graphs=true is ignored on cpu" in out
    assert "cuda_graphs off, data in host memory" in out
    assert "resuming from" in out
    assert [h["step"] for h in whole["history"]] == [4, 8, 12]  # 100 // 24: the 4 kept
    assert [h["step"] for h in resumed["history"]] == [4, 8, 12]
    for name, weight in whole["model"].items():
        torch.testing.assert_close(resumed["model"][name], weight, atol=0, rtol=0)


@pytest.mark.skipif(torch.cuda.is_available(), reason="tests the CPU fallback")
def test_cuda_graphs_refuse_a_batch_larger_than_a_ranks_share(tmp_path: Path) -> None:
    dataset = write_dataset(tmp_path / "ds", n_train=20, n_val=8)
    cfg = TrainConfig(epochs=1, batch_size=32, cuda_graphs=True)
    job = TrainingJob(TrainJobSpec(train=cfg, dataset=dataset, out_dir=tmp_path / "run"))
    with pytest.raises(ConfigError, match=r"batch_size=32 exceeds the 20 training samples"):
        job()


def test_cuda_graphs_cannot_change_when_a_run_resumes(tmp_path: Path) -> None:
    dataset = write_dataset(tmp_path / "ds", n_train=48, n_val=16)
    latest = _train(dataset, tmp_path / "run", 1, device="cpu")
    cfg = TrainConfig(epochs=2, batch_size=24, precision="fp32", cuda_graphs=True)
    job = TrainingJob(TrainJobSpec(train=cfg, dataset=dataset, out_dir=tmp_path / "run"))
    with pytest.raises(ConfigError, match=r"other settings \(cuda_graphs\)") as error:
        job()
    assert str(latest.parent) in str(error.value)


def test_checkpoints_from_before_the_speed_fields_still_resume(tmp_path: Path) -> None:
    dataset = write_dataset(tmp_path / "ds", n_train=48, n_val=16)
    latest = _train(dataset, tmp_path / "run", 1, device="cpu")
    state = load_state(latest)
    for new_field in ("cuda_graphs", "data_placement", "ddp_bucket_cap_mb"):
        state["run"].pop(new_field, None)
    torch.save(state, latest)  # as written by a run that did not know these fields,
    latest.with_name(f"{latest.name}.sha256").unlink()  # nor kept checkpoint hashes
    resumed = load_state(_train(dataset, tmp_path / "run", 2, device="cpu"))
    assert [h["epoch"] for h in resumed["history"]] == [1, 2]
