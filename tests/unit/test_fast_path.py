"""The fast path: memory format, compilation, fused optimizers, DDP wrapping, host-to-device
prefetch and the CUDA-graph settings, on CPU (tests/gpu runs the CUDA side)."""

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from pydantic import ValidationError

from tasks.errors import ConfigError
from tasks.hashing import sha256_file
from tasks.preprocess.dataset import read_manifest
from tasks.preprocess.ref import DatasetRef
from tasks.train.checkpoint import latest_checkpoint, load_state
from tasks.train.config import TrainConfig
from tasks.train.data import (
    Placement,
    Split,
    load_split_to,
    place_on_device,
    rank_batches,
    steps_per_epoch,
)
from tasks.train.distributed import DistContext, wrap_ddp
from tasks.train.job import Progress, TrainingJob, TrainJobSpec
from tasks.train.loop import Trainer, make_optimizer
from tasks.train.models import (
    ReferenceCNN,
    build_model,
    place_model,
    use_channels_last,
    uses_cuda_graphs,
)
from tasks.train.prefetch import Prefetcher
from tests.services import free_port
from tests.unit.datasets import write_dataset

CPU = torch.device("cpu")
NHWC = torch.channels_last


@pytest.fixture(autouse=True)
def _restore_torch_threads() -> Iterator[None]:
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def _write_rgb_dataset(root: Path, n: int = 8) -> DatasetRef:
    """A 3-channel dataset: with one channel, NCHW and NHWC are the same bytes."""
    root.mkdir(parents=True)
    rng = np.random.default_rng(0)
    splits = {}
    for split in ("train", "val", "test"):
        names = {"x": f"{split}-00000.x.npy", "y": f"{split}-00000.y.npy"}
        np.save(root / names["x"], rng.normal(size=(n, 3, 12, 12)).astype(np.float32))
        np.save(root / names["y"], rng.integers(0, 2, n).astype(np.int64))
        hashes = {f"{k}_sha256": sha256_file(root / v) for k, v in names.items()}
        splits[split] = [{**names, **hashes, "n": n}]
    manifest = {
        "format_version": 1,
        "content_hash": "rgb",
        "cache_key": "rgb",
        "counts": {split: n for split in splits},
        "shape": [3, 12, 12],
        "classes": ["a", "b"],
        "mean": [0.0] * 3,
        "std": [1.0] * 3,
        "splits": splits,
    }
    (root / "manifest.json").write_text(json.dumps(manifest))
    return read_manifest(root)


@pytest.mark.parametrize("value", ["auto", "on", "off"])
def test_channels_last_takes_auto_on_or_off(value: str) -> None:
    assert TrainConfig(channels_last=value).channels_last == value


@pytest.mark.parametrize("field, value", [("channels_last", "yes"), ("compile", "maybe")])
def test_fast_path_fields_refuse_other_values(field: str, value: str) -> None:
    with pytest.raises(ValidationError, match=field):
        TrainConfig(**{field: value})


def test_compile_is_off_by_default() -> None:
    assert TrainConfig().compile is False


def test_channels_last_auto_is_on_for_cuda_and_for_cpus_with_onednn() -> None:
    assert use_channels_last("auto", torch.device("cuda", 0))
    assert use_channels_last("auto", CPU) == torch.backends.mkldnn.is_available()
    assert use_channels_last("on", CPU) and not use_channels_last("off", torch.device("cuda"))


@pytest.mark.parametrize("setting, expected", [("on", True), ("off", False)])
def test_place_model_sets_the_memory_format_of_conv_weights(setting: str, expected: bool) -> None:
    cfg = TrainConfig(channels_last=setting)
    model = place_model(build_model(cfg, (3, 12, 12), 4), cfg, CPU)
    assert isinstance(model, ReferenceCNN)
    assert model.conv2.weight.is_contiguous(memory_format=NHWC) is expected


def test_a_compiled_model_keeps_plain_state_dict_keys_and_outputs() -> None:
    torch.manual_seed(0)
    eager = build_model(TrainConfig(), (1, 12, 12), 4)
    compiled = build_model(TrainConfig(compile=True), (1, 12, 12), 4)
    compiled.load_state_dict(eager.state_dict())
    compiled = place_model(compiled, TrainConfig(compile=True, channels_last="off"), CPU)
    assert compiled._compiled_call_impl is not None  # what Module.compile() sets
    assert list(compiled.state_dict()) == list(eager.state_dict())
    x = torch.randn(5, 1, 12, 12)
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), eager(x), atol=1e-5, rtol=1e-4)


def test_the_reference_cnn_computes_the_founding_forward_and_gradients_exactly() -> None:
    torch.manual_seed(0)
    net = ReferenceCNN(1, 10, 28, 28)
    x, y = torch.randn(64, 1, 28, 28), torch.randint(0, 10, (64,))

    def founding(inputs: torch.Tensor) -> torch.Tensor:  # the founding material's order
        h = net.pool(torch.relu(net.conv1(inputs)))
        h = net.pool(torch.relu(net.conv2(h)))
        return net.fc(torch.flatten(h, 1))

    grads = []
    for forward in (founding, net):
        net.zero_grad()
        loss = torch.nn.functional.cross_entropy(forward(x), y)
        loss.backward()
        grads.append([p.grad.clone() for p in net.parameters() if p.grad is not None])
    for ours, theirs in zip(grads[1], grads[0], strict=True):
        torch.testing.assert_close(ours, theirs, atol=0, rtol=0)
    torch.testing.assert_close(net(x), founding(x), atol=0, rtol=0)


def test_channels_last_data_stays_nhwc_in_every_batch(tmp_path: Path) -> None:
    ref = _write_rgb_dataset(tmp_path / "rgb")
    nhwc = load_split_to(ref.path, "train", CPU, channels_last=True)
    plain = load_split_to(ref.path, "train", CPU)
    x, _ = nhwc.batch(torch.tensor([5, 0, 3]), CPU)
    assert x.is_contiguous(memory_format=NHWC) and not x.is_contiguous()
    assert plain.x.is_contiguous()
    torch.testing.assert_close(x, plain.x[[5, 0, 3]], atol=0, rtol=0)


@pytest.mark.parametrize("optimizer", ["adamw", "sgd"])
def test_optimizers_are_fused_on_cpu(optimizer: str) -> None:
    cfg = TrainConfig(optimizer=optimizer)
    opt = make_optimizer(cfg, build_model(cfg, (1, 12, 12), 4))
    assert opt.defaults["fused"] is True


def test_a_world_of_one_is_not_wrapped_in_ddp() -> None:
    model = torch.nn.Linear(2, 2)
    assert wrap_ddp(model, DistContext(0, 1, 0, CPU, None)) is model


def test_a_run_resumes_after_its_speed_settings_changed(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    dataset = write_dataset(tmp_path / "ds", n_train=64, n_val=32)
    slow = TrainConfig(epochs=1, batch_size=32, device="cpu", channels_last="off")
    TrainingJob(TrainJobSpec(train=slow, dataset=dataset, out_dir=tmp_path / "run"))()
    assert "channels_last off, compile off" in capsys.readouterr().out
    fast = slow.model_copy(update={"epochs": 2, "channels_last": "on"})
    ref = TrainingJob(TrainJobSpec(train=fast, dataset=dataset, out_dir=tmp_path / "run"))()
    out = capsys.readouterr().out
    assert "channels_last on" in out and "after epoch 1" in out
    assert ref is not None
    assert [h["epoch"] for h in json.loads(ref.history_path.read_text())] == [1, 2]


_EXIT_SCRIPT = """
import atexit, sys, types
import submitit
from tasks.train import distributed
atexit.register(print, "normal teardown ran")
env = types.SimpleNamespace(cluster=sys.argv[1])
submitit.JobEnvironment = lambda: env
if sys.argv[3] == "task":  # what `python -m submitit.core._submit` looks like
    sys.modules["__main__"].__spec__ = types.SimpleNamespace(name="submitit.core._submit")
distributed.exit_fast_at_shutdown()
print("result written", end="")  # unflushed: the fast exit must flush it
if sys.argv[2] == "fail":
    raise ValueError("after training")
"""


@pytest.mark.parametrize(
    "cluster, process, outcome, code, teardown",
    [
        ("local", "task", "ok", 0, False),
        ("slurm", "task", "fail", 1, False),
        ("debug", "task", "ok", 0, True),
        ("slurm", "caller", "fail", 1, True),  # e.g. pytest inside a Slurm allocation
    ],
)
def test_rank_processes_skip_the_interpreter_teardown_but_keep_output_and_exit_code(
    cluster: str, process: str, outcome: str, code: int, teardown: bool
) -> None:
    done = subprocess.run(
        [sys.executable, "-c", _EXIT_SCRIPT, cluster, outcome, process],
        capture_output=True,
        text=True,
        cwd=Path(__file__).parents[2],
    )
    assert done.returncode == code, done.stderr
    assert done.stdout.startswith("result written")
    assert ("normal teardown ran" in done.stdout) is teardown


# --- DDP buckets -------------------------------------------------------------------------


@pytest.mark.parametrize("cap", [0.5, 2000.0])
def test_ddp_bucket_cap_outside_1_to_1024_mb_is_refused(cap: float) -> None:
    with pytest.raises(ValidationError, match="ddp_bucket_cap_mb"):
        TrainConfig(ddp_bucket_cap_mb=cap)


def test_ddp_gets_the_bucket_cap_and_a_static_graph() -> None:
    torch.distributed.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1
    )
    try:
        # wrap_ddp reads the world size only to decide whether to wrap at all.
        ctx = DistContext(0, 2, 0, CPU, "gloo")
        ddp = wrap_ddp(build_model(TrainConfig(), (1, 12, 12), 4), ctx, bucket_cap_mb=5.0)
        assert isinstance(ddp, torch.nn.parallel.DistributedDataParallel)
        assert ddp.bucket_bytes_cap == 5 * 2**20
        assert ddp.static_graph and ddp.gradient_as_bucket_view
        x, y = torch.randn(8, 1, 12, 12), torch.randint(0, 4, (8,))
        for _ in range(2):  # a static graph is learnt in the first step, used in the second
            ddp.zero_grad(set_to_none=True)
            torch.nn.functional.cross_entropy(ddp(x), y).backward()
        assert all(p.grad is not None for p in ddp.parameters())
    finally:
        torch.distributed.destroy_process_group()


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
    ref = _write_rgb_dataset(tmp_path / "rgb")
    assert place_on_device(placement, CPU, 10**15)  # on CPU the host is the device
    split = load_split_to(ref.path, "train", CPU, channels_last=True, placement=placement)
    assert split.on_host and split.x.is_contiguous(memory_format=NHWC)


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
    model = place_model(build_model(cfg, (1, 12, 12), 4), cfg, CPU)
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


class _StopsAfterEpoch1(TrainingJob):
    """Dies right after its first checkpoint, as a preempted job does."""

    def _record(self, trainer: Trainer, progress: Progress, *args: Any) -> None:
        super()._record(trainer, progress, *args)
        if progress.epoch == 1:
            raise _Preempted


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
    torch.save(state, latest)  # as written by a run that did not know these fields
    resumed = load_state(_train(dataset, tmp_path / "run", 2, device="cpu"))
    assert [h["epoch"] for h in resumed["history"]] == [1, 2]
