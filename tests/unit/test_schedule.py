"""train.schedule's shapes against implementations that are not trainflow's: Hugging Face
transformers' schedule functions and torch's LRScheduler classes, each stepped through a real
optimizer here, the learning rate read from its param group after every step."""

import json
import math
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from torch.optim import lr_scheduler as torch_sched
from transformers import optimization as hf

from tests.unit.datasets import write_dataset
from trainflow.cluster.config import ClusterConfig
from trainflow.cluster.executor import make_executor
from trainflow.cluster.jobs import wait_for_job
from trainflow.errors import ConfigError
from trainflow.tasks.train.config import TrainConfig
from trainflow.tasks.train.job import TrainingJob, TrainJobSpec
from trainflow.tasks.train.ref import CheckpointRef
from trainflow.tasks.train.schedule import schedule_for

PEAK, TOTAL = 3e-3, 40
Scheduler = Callable[[torch.optim.Optimizer], torch_sched.LRScheduler]


def reference(make: Scheduler, steps: int = TOTAL + 3) -> list[float]:
    """The learning rate of each of `steps` optimizer steps under the scheduler `make` builds."""
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=PEAK)
    scheduler = make(optimizer)
    rates = []
    for _ in range(steps):
        rates.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    return rates


def ours(steps: int = TOTAL + 3, **keys: object) -> list[float]:
    schedule = schedule_for(TrainConfig(**keys), TOTAL)
    return [schedule.lr(step, TOTAL, PEAK) for step in range(steps)]


def test_the_default_is_a_cosine_from_the_peak_to_zero_with_no_warm_up_bit_for_bit() -> None:
    want = [0.5 * PEAK * (1.0 + math.cos(math.pi * min(s / TOTAL, 1.0))) for s in range(TOTAL + 3)]
    assert ours() == want  # exactly: runs that set no schedule key train as they always did
    # transformers' cosine rises again past the last step (ours stays at its end): the run only
    hf_cosine = reference(lambda o: hf.get_cosine_schedule_with_warmup(o, 0, TOTAL), TOTAL + 1)
    assert ours(TOTAL + 1) == pytest.approx(hf_cosine, rel=1e-12, abs=1e-15)


@pytest.mark.parametrize("warmup,ratio", [(5, 0.0), (5, 0.1), (0, 0.25)])
def test_cosine_with_warm_up_and_floor_is_transformers_cosine_with_min_lr(
    warmup: int, ratio: float
) -> None:
    want = reference(
        lambda o: hf.get_cosine_with_min_lr_schedule_with_warmup(
            o, warmup, TOTAL, min_lr_rate=ratio
        ),
        TOTAL + 1,  # past the last step transformers' cosine rises again, ours stays at its end
    )
    got = ours(TOTAL + 1, warmup_steps=warmup, min_lr_ratio=ratio)
    assert got == pytest.approx(want, rel=1e-12, abs=1e-15)
    assert ours(TOTAL + 3, warmup_steps=warmup, min_lr_ratio=ratio)[-3:] == [ratio * PEAK] * 3


def test_linear_with_warm_up_is_transformers_linear() -> None:
    want = reference(lambda o: hf.get_linear_schedule_with_warmup(o, 6, TOTAL))
    assert ours(schedule="linear", warmup_steps=6) == pytest.approx(want, rel=1e-12, abs=1e-15)


def test_linear_with_a_floor_is_torchs_linear_warm_up_then_linear_decay() -> None:
    # LinearLR's factors multiply step by step: equal to rounding, hence the tolerance.
    def make(o: torch.optim.Optimizer) -> torch_sched.LRScheduler:
        warm = torch_sched.LambdaLR(o, lambda s: s / 8)
        decay = torch_sched.LinearLR(o, start_factor=1.0, end_factor=0.2, total_iters=TOTAL - 8)
        return torch_sched.SequentialLR(o, [warm, decay], milestones=[8])

    got = ours(schedule="linear", warmup_fraction=0.2, min_lr_ratio=0.2)
    assert got == pytest.approx(reference(make), rel=1e-9)


def test_constant_with_warm_up_is_transformers_constant() -> None:
    want = reference(lambda o: hf.get_constant_schedule_with_warmup(o, 4))
    assert ours(schedule="constant", warmup_steps=4) == pytest.approx(want, rel=1e-12)


@pytest.mark.parametrize("warmup,ratio,fraction", [(4, 0.0, 0.25), (0, 0.1, None), (0, 0.3, 0.5)])
def test_wsd_is_transformers_wsd_with_a_linear_decay(
    warmup: int, ratio: float, fraction: float | None
) -> None:
    # transformers' warm-up starts at min_lr_ratio x the peak, ours at 0: a floor without warm-up
    decay = math.ceil((fraction or 0.1) * TOTAL)  # unset: the last 10%
    want = reference(
        lambda o: hf.get_wsd_schedule(
            o, warmup, decay, TOTAL, decay_type="linear", min_lr_ratio=ratio
        )
    )
    got = ours(schedule="wsd", warmup_steps=warmup, min_lr_ratio=ratio, decay_fraction=fraction)
    assert got == pytest.approx(want, rel=1e-12, abs=1e-15)


def test_wsd_with_warm_up_and_floor_is_torchs_three_phases() -> None:
    def make(o: torch.optim.Optimizer) -> torch_sched.LRScheduler:
        warm = torch_sched.LambdaLR(o, lambda s: s / 5)
        stable = torch_sched.ConstantLR(o, factor=1.0, total_iters=0)
        decay = torch_sched.LinearLR(o, start_factor=1.0, end_factor=0.1, total_iters=10)
        return torch_sched.SequentialLR(o, [warm, stable, decay], milestones=[5, TOTAL - 10])

    got = ours(schedule="wsd", warmup_steps=5, min_lr_ratio=0.1, decay_fraction=0.25)
    assert got == pytest.approx(reference(make), rel=1e-9)
    assert got[5 : TOTAL - 10] == [PEAK] * (TOTAL - 15)


def test_a_warm_up_longer_than_the_run_is_refused_in_one_line() -> None:
    with pytest.raises(ConfigError, match=r"^train.warmup_steps: .* 50 warm-up steps exceed"):
        schedule_for(TrainConfig(warmup_steps=50), TOTAL)
    with pytest.raises(ConfigError, match=r"36 warm-up \+ 8 decay steps exceed the run's 40"):
        schedule_for(TrainConfig(schedule="wsd", warmup_steps=36, decay_fraction=0.2), TOTAL)


@pytest.mark.parametrize(
    "keys,message",
    [
        ({"warmup_steps": 5, "warmup_fraction": 0.1}, "both set the warm-up: set one of them"),
        ({"schedule": "constant", "min_lr_ratio": 0.1}, "train.min_lr_ratio has no effect"),
        ({"decay_fraction": 0.2}, "train.decay_fraction is for train.schedule=wsd, not cosine"),
        (
            {"schedule": "wsd", "warmup_fraction": 0.6, "decay_fraction": 0.5},
            "add up to more than the whole run",
        ),
    ],
)
def test_keys_that_disagree_are_refused_at_construction(
    keys: dict[str, object], message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        TrainConfig(**keys)


def test_the_training_job_steps_through_its_schedule(tmp_path: Path) -> None:
    """A one-rank job (submitit's debug executor): 256 samples at batch 32 make 8 steps an
    epoch, 32 in 4 epochs; each epoch's lr is its last step's (steps 7, 15, 23, 31)."""
    dataset = write_dataset(tmp_path / "ds")
    cfg = TrainConfig(
        epochs=4,
        batch_size=32,
        device="cpu",
        precision="fp32",
        test_after_training=False,
        schedule="wsd",
        warmup_steps=10,
        decay_fraction=0.25,  # steps 24-31 decay
        min_lr_ratio=0.1,
    )
    spec = TrainJobSpec(train=cfg, dataset=dataset, out_dir=tmp_path / "run")
    executor = make_executor(ClusterConfig(executor="debug", ranks_per_node=1), tmp_path / "jobs")
    ref = wait_for_job(executor.submit(TrainingJob(spec)), lambda line: None)
    assert isinstance(ref, CheckpointRef)
    history = json.loads(ref.history_path.read_text())
    peak = cfg.lr
    want = [0.7 * peak, peak, peak, peak * (0.1 + 0.9 * (1 - 7 / 8))]
    assert [h["lr"] for h in history] == pytest.approx(want, rel=1e-12)
