"""Time limits under train.strategy=fsdp, for real (2 gloo ranks, submitit's local executor):
the job checkpoints its shards inside an epoch before each limit (torch.distributed.checkpoint),
requeues, and ends with exactly the weights, optimizer state and metrics of a run without a
limit; and a stop under gradient accumulation (a run continued on half its ranks, which keeps
its global batch) resumes at the right micro-batch.

The machinery (dataset, job spec, executor, slow steps) is tests/unit/test_time_limit.py's.
"""

import shutil
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import cloudpickle
import pytest
import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from tests.slow_steps import SlowSteps
from tests.unit.test_time_limit import _executor, _spec, _untimed, dataset
from trainflow.cluster.jobs import wait_for_job
from trainflow.tasks.preprocess.ref import DatasetRef
from trainflow.tasks.train.checkpointing.sharded_checkpoint import (
    TRAIN_STATE,
    checkpoint_name,
    sharded_checkpoints,
)
from trainflow.tasks.train.job import TrainingJob, TrainJobSpec
from trainflow.tasks.train.ref import CheckpointRef

cloudpickle.register_pickle_by_value(sys.modules[__name__])

__all__ = ["dataset"]  # the module fixture, shared with the ddp tests

LIMIT_S = 40.0
"""The accumulation test's time limit: start-up (7 to 15 s here, by load), a few steps and a
save fit in it; its epoch 2 (96 steps on one rank, ACCUMULATION_FLOOR_S each at least) does
not. The floor under each step (tests.slow_steps), not more data, makes the epoch long: this
machine's throughput varied 4x with its load, and the local executor starts a job at most 6
times, so the attempts must be few on a loaded machine."""
ACCUMULATION_FLOOR_S = 0.4
"""The accumulation test's step floor: 96 x 0.4 = 38.4 s of steps alone outlast what any
attempt has before its deadline (40 - 5 s of margin), so the first attempt stops inside
epoch 2 on the fastest machine. Each attempt here also reserves ~7.5 s for its save (1.5 x
the 5 s a save is taken to cost before one is measured), so an idle attempt (about 4 s of
start-up) trains (40 - 5 - 7.5 - 4) / 0.45 = 52 steps and the epoch ends in its 2nd attempt;
a loaded one (15 s of start-up) 25 steps: 4 attempts of the local executor's 6."""
FSDP_LIMIT_S, FSDP_FLOOR_S = 60.0, 0.55
"""The 2-rank FSDP test's limit and step floor. Its attempts' fixed costs (the process, FSDP's
set-up and resume, the save reserved, the margin) took 15 s idle and up to 38 s on a loaded
CI run, where 40 s attempts trained 21 to 53 steps and its 192 steps needed more than 6. Here
an idle attempt trains about (60 - 15) / 0.55 = 82 steps (3 attempts at least: 2 requeues)
and a loaded one at least (60 - 38) / 0.55 = 40 (5 attempts at most)."""


def _fsdp(dataset: DatasetRef, out_dir: Path) -> TrainJobSpec:
    """The time-limit tests' job under fsdp, with a model without BatchNorm: each FSDP rank
    keeps running statistics of its own, and a sharded checkpoint stores one copy of a
    replicated buffer (rank 0's), so a resumed rank 1 would evaluate with rank 0's."""
    return _spec(dataset, out_dir, strategy="fsdp", model="reference_cnn", width=None)


def _final(out_dir: Path) -> dict[str, Any]:
    """The newest checkpoint's train state, with its whole model and optimizer state."""
    folder = sharded_checkpoints(out_dir / "checkpoints")[0]
    state: dict[str, Any] = torch.load(folder / TRAIN_STATE, weights_only=True)
    dcp_to_torch_save(folder, out_dir / "whole.pt")
    whole = torch.load(out_dir / "whole.pt", weights_only=False)
    return {**state, "tensors": _tensors(whole)}


def _tensors(state: Any, prefix: str = "") -> dict[str, torch.Tensor]:
    if isinstance(state, torch.Tensor):
        return {prefix: state}
    items = state.items() if isinstance(state, dict) else enumerate(state)
    found: dict[str, torch.Tensor] = {}
    for key, value in items:
        if isinstance(value, dict | list | tuple | torch.Tensor):
            found |= _tensors(value, f"{prefix}.{key}")
    return found


def _kept(lines: list[str]) -> Callable[[str], None]:
    """A job-line callback that keeps each line, and prints it (shown when a test fails)."""

    def keep(line: str) -> None:
        lines.append(line)
        print(f"{time.strftime('%H:%M:%S')} {line}")

    return keep


def _steps(lines: list[str], before: str) -> list[int]:
    """The step number after `before` in each line."""
    return [int(ln.split(before, 1)[1].split()[0]) for ln in lines]


def _assert_same_end(got: dict[str, Any], want: dict[str, Any]) -> None:
    """Bit-equal: every step computes what the run without a limit computed, in the same
    order on the same ranks; a resume reloads the exact fp32 bytes (DCP), and the learning
    rate is a function of the step."""
    assert (got["epoch"], got["step"], got["epoch_batches"]) == (want["epoch"], want["step"], 0)
    assert got["tensors"].keys() == want["tensors"].keys()
    for name, tensor in want["tensors"].items():
        torch.testing.assert_close(got["tensors"][name], tensor, rtol=0, atol=0, msg=name)
    for a, b in zip(got["history"], want["history"], strict=True):
        assert _untimed(a) == _untimed(b)


@pytest.fixture(scope="module")
def straight(dataset: DatasetRef, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The out_dir of a 2-rank fsdp run without a time limit."""
    root = tmp_path_factory.mktemp("straight")
    spec = _fsdp(dataset, root / "run")
    job = _executor(root / "jobs", None).submit(TrainingJob(spec))
    assert isinstance(wait_for_job(job, lambda line: None), CheckpointRef)
    return spec.out_dir


@pytest.mark.services
@pytest.mark.timeout(600)
def test_an_fsdp_job_longer_than_its_time_limit_ends_as_one_without(
    dataset: DatasetRef, straight: Path, tmp_path: Path
) -> None:
    lines: list[str] = []
    spec = _fsdp(dataset, tmp_path / "limited")
    job = _executor(tmp_path / "jobs", FSDP_LIMIT_S).submit(SlowSteps(spec, FSDP_FLOOR_S))
    assert isinstance(wait_for_job(job, _kept(lines)), CheckpointRef)
    stops = [ln for ln in lines if "checkpointing at step" in ln]
    resumed = [ln for ln in lines if " continues from step " in ln]
    # More requeues than spec.max_requeues (0): those that made progress do not count.
    assert len(resumed) >= 2, "\n".join(lines)
    assert len(stops) == len(resumed)
    assert any(", batch " in ln for ln in resumed)  # continued inside an epoch
    # ... from a sharded checkpoint taken there, each attempt where the one before stopped
    assert any("resuming from " in ln and "+0" in ln for ln in lines), "\n".join(lines)
    assert _steps(stops, "checkpointing at step ") == _steps(resumed, "continues from step ")
    _assert_same_end(_final(spec.out_dir), _final(straight))


@pytest.mark.services
@pytest.mark.timeout(600)
def test_a_time_limit_stop_under_gradient_accumulation_resumes_at_its_micro_batch(
    dataset: DatasetRef, straight: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # One rank continues the 2-rank run after its epoch 1, with 2 micro-batches per step
    # (its global batch kept), under a limit that stops it inside epoch 2.
    limited = _fsdp(dataset, tmp_path / "limited")
    plain = _fsdp(dataset, tmp_path / "plain")
    for spec in (limited, plain):  # the run's out_dir as it was after epoch 1
        epoch_1 = spec.out_dir / "checkpoints" / "epoch-000001"
        shutil.copytree(straight / "checkpoints" / "epoch-000001", epoch_1)
        shutil.copy(straight / "best.pt", spec.out_dir / "best.pt")  # the same in both
    lines: list[str] = []
    executor = _executor(tmp_path / "jobs", LIMIT_S, ranks=1)
    job = executor.submit(SlowSteps(limited, ACCUMULATION_FLOOR_S))
    assert isinstance(wait_for_job(job, _kept(lines)), CheckpointRef)
    assert any("1 ranks x 2 micro-batches of 64 per step" in ln for ln in lines)
    stops = [ln for ln in lines if "checkpointing at step" in ln]
    resumed = [ln for ln in lines if " continues from step " in ln and ", batch " in ln]
    assert resumed, "\n".join(lines)  # stopped inside epoch 2, continued there
    assert _steps(stops, "checkpointing at step ") == _steps(resumed, "continues from step ")

    TrainingJob(plain)()  # the same continuation on one rank, in this process, without a limit
    capsys.readouterr()
    _assert_same_end(_final(limited.out_dir), _final(plain.out_dir))


def test_a_sharded_checkpoint_inside_an_epoch_sorts_between_the_epochs_around_it(
    tmp_path: Path,
) -> None:
    for epoch, steps in ((3, 0), (3, 40), (3, 7), (2, 90)):
        (tmp_path / checkpoint_name(epoch, steps)).mkdir()
    (tmp_path / f"{checkpoint_name(4, 12)}.tmp").mkdir()  # a save cut off: never resumed
    assert [p.name for p in sharded_checkpoints(tmp_path)] == [
        "epoch-000003+000040",
        "epoch-000003+000007",
        "epoch-000003",
        "epoch-000002+000090",
    ]
