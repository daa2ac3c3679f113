"""The fast path: memory format, compilation, fused optimizers, DDP wrapping and buckets, on CPU
(tests/unit/test_prefetch_and_graphs.py: data placement, prefetch, CUDA-graph settings)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from pydantic import ValidationError

from tests.services import free_port
from tests.unit.datasets import write_dataset, write_rgb_dataset
from trainflow.tasks.spec import image_classification
from trainflow.tasks.train.config import TrainConfig
from trainflow.tasks.train.data import (
    Split,
    load_split_to,
)
from trainflow.tasks.train.distributed import DistContext, wrap_ddp
from trainflow.tasks.train.job import TrainingJob, TrainJobSpec
from trainflow.tasks.train.model_plugins import build_model
from trainflow.tasks.train.models import (
    ReferenceCNN,
    place_model,
    use_channels_last,
)
from trainflow.tasks.train.optimizers import make_optimizer

CPU = torch.device("cpu")
NHWC = torch.channels_last


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


def test_channels_last_auto_is_off_on_cpu_for_convolutions_narrower_than_8_channels() -> None:
    assert not use_channels_last("auto", CPU, narrowest=4)
    assert use_channels_last("auto", CPU, narrowest=8) == torch.backends.mkldnn.is_available()
    assert use_channels_last("auto", torch.device("cuda", 0), narrowest=4)
    assert use_channels_last("on", CPU, narrowest=4)  # asked for explicitly: as asked


@pytest.mark.services
@pytest.mark.timeout(120)
def test_a_width_4_resnet_trains_on_cpu_with_the_auto_memory_format() -> None:
    # With NHWC this spins for minutes in oneDNN's 1x1 conv backward (torch 2.13.0+cpu).
    cfg = TrainConfig(model="resnet", width=4, channels_last="auto")
    model = place_model(build_model(cfg, image_classification((3, 32, 32), 10)), cfg, CPU)
    x = torch.randn(128, 3, 32, 32)
    model(x).logsumexp(1).mean().backward()
    assert all(p.grad is not None for p in model.parameters())


@pytest.mark.parametrize("setting, expected", [("on", True), ("off", False)])
def test_place_model_sets_the_memory_format_of_conv_weights(setting: str, expected: bool) -> None:
    cfg = TrainConfig(channels_last=setting)
    model = place_model(build_model(cfg, image_classification((3, 12, 12), 4)), cfg, CPU)
    assert isinstance(model, ReferenceCNN)
    assert model.conv2.weight.is_contiguous(memory_format=NHWC) is expected


@pytest.mark.services
def test_a_compiled_model_keeps_plain_state_dict_keys_and_outputs() -> None:
    torch.manual_seed(0)
    eager = build_model(TrainConfig(), image_classification((1, 12, 12), 4))
    compiled = build_model(TrainConfig(compile=True), image_classification((1, 12, 12), 4))
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
    ref = write_rgb_dataset(tmp_path / "rgb")
    nhwc = load_split_to(ref.path, "train", CPU, channels_last=True)
    plain = load_split_to(ref.path, "train", CPU)
    assert isinstance(nhwc, Split) and isinstance(plain, Split)
    x, _ = nhwc.batch(torch.tensor([5, 0, 3]), CPU)
    assert x.is_contiguous(memory_format=NHWC) and not x.is_contiguous()
    assert plain.x.is_contiguous()
    torch.testing.assert_close(x, plain.x[[5, 0, 3]], atol=0, rtol=0)


@pytest.mark.parametrize("optimizer", ["adamw", "sgd"])
def test_optimizers_are_fused_on_cpu(optimizer: str) -> None:
    cfg = TrainConfig(optimizer=optimizer)
    opt = make_optimizer(cfg, build_model(cfg, image_classification((1, 12, 12), 4)))
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
from trainflow.tasks.train import distributed
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
@pytest.mark.services
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
        ddp = wrap_ddp(
            build_model(TrainConfig(), image_classification((1, 12, 12), 4)), ctx, bucket_cap_mb=5.0
        )
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
