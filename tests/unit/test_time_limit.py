"""The time-limit rule (tasks.train.limits.time_limit.plan) fed with a real step and a real save,
and
the training job run for real under the local executor's time limit: it checkpoints before the
limit, requeues, and ends with exactly the weights and metrics of a run without a limit; a job
whose attempts make no progress fails with one clear line after cluster.max_requeues.
"""

import subprocess
import sys
import time
from pathlib import Path

import cloudpickle
import pytest
import submitit
import torch

from tests.slow_steps import SlowSteps
from tests.unit.datasets import write_dataset
from trainflow.cluster.config import ClusterConfig
from trainflow.cluster.executor import make_executor
from trainflow.cluster.jobs import wait_for_job
from trainflow.errors import JobError
from trainflow.tasks.preprocess.ref import DatasetRef
from trainflow.tasks.train.checkpointing.checkpoint import (
    checkpoint_epoch,
    checkpoints,
    latest_checkpoint,
    load_state,
    save_checkpoint,
)
from trainflow.tasks.train.checkpointing.checkpoint import training_state as full_state
from trainflow.tasks.train.config import TrainConfig
from trainflow.tasks.train.distributed import DistContext
from trainflow.tasks.train.job import TrainingJob, TrainJobSpec
from trainflow.tasks.train.limits.time_limit import (
    SAVE_FACTOR,
    Estimates,
    TimeLimit,
    parse_time_left,
    plan,
    squeue_job_id,
)
from trainflow.tasks.train.models import ReferenceCNN
from trainflow.tasks.train.ref import CheckpointRef

cloudpickle.register_pickle_by_value(sys.modules[__name__])

_TIMED = {"samples_per_s", "epoch_time_s", "achieved_flops_per_s", "mfu", "slowest_rank"}
"""Wall-clock figures of an epoch (and rank_*: per-rank timings): never equal across runs."""


def _untimed(entry: dict[str, float]) -> dict[str, float]:
    return {k: v for k, v in entry.items() if k not in _TIMED and not k.startswith("rank_")}


def _measured(tmp_path: Path) -> tuple[float, float]:
    """(seconds a training step takes, seconds a checkpoint save takes), measured here."""
    model = ReferenceCNN(1, 4, 12, 12)
    optimizer = torch.optim.AdamW(model.parameters())
    x, y = torch.randn(64, 1, 12, 12), torch.randint(0, 4, (64,))
    started = time.perf_counter()
    for _ in range(5):
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()
    step_s = (time.perf_counter() - started) / 5
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    state = full_state(model, optimizer, scaler, {"epoch": 1, "step": 5})
    started = time.perf_counter()
    save_checkpoint(state, tmp_path)
    return step_s, time.perf_counter() - started


@pytest.mark.parametrize("steps_left", [1, 7, 400])
def test_the_rule_stops_at_the_last_step_whose_save_still_fits(
    steps_left: int, tmp_path: Path
) -> None:
    step_s, save_s = _measured(tmp_path)
    eval_s = 3 * step_s
    save = SAVE_FACTOR * save_s
    whole = steps_left * step_s + eval_s + save  # the epoch, its validation and its save
    for remaining in (0.0, save / 2, save + 2.5 * step_s, whole - step_s / 2, whole * 1.01, 1e4):
        decided = plan(remaining, steps_left, step_s, save_s, eval_s)
        assert 1 <= decided.check_in <= steps_left, (remaining, decided)
        if decided.stop_in is None:  # nothing to do before the epoch's end
            assert remaining > whole, (remaining, decided)
            slack = remaining - whole
            assert decided.check_in * step_s <= max(slack / 2, step_s)  # a look before then
            continue
        assert remaining <= whole, (remaining, decided)
        assert decided.stop_in < steps_left  # a batch is left for the next attempt
        if decided.stop_in > 0:  # the steps and the save fit ...
            assert decided.stop_in * step_s + save <= remaining
        if decided.stop_in < steps_left - 1:  # ... and one step more would not
            assert (decided.stop_in + 1) * step_s + save > remaining
        assert decided.check_in <= max(decided.stop_in, 1)  # another look before the stop


def test_the_rule_takes_one_step_before_anything_is_measured() -> None:
    assert plan(100.0, 50, None, 1.0, 0.0).stop_in is None
    assert plan(100.0, 50, None, 1.0, 0.0).check_in == 1
    assert plan(1.0, 50, None, 1.0, 0.0).stop_in == 0  # not even a save fits: stop now


def test_a_step_time_carried_from_before_is_checked_after_one_step_measured() -> None:
    # The checkpoint's step time was a faster world's: planned with, then measured at once.
    ctx = DistContext(0, 1, 0, torch.device("cpu"), "gloo")
    limit = TimeLimit(ctx, True, 5.0, deadline=time.monotonic() + 20, estimates=Estimates(1e-4))
    limit.start_epoch(0, 500)
    assert not limit.should_stop(0)
    assert limit.next_check == 1
    time.sleep(0.05)  # the step, 500x slower than carried: the rest of the epoch cannot fit
    assert not limit.should_stop(1)
    assert limit.estimates.step_s is not None and limit.estimates.step_s >= 0.05
    assert 1 < limit.stop_at < 500


def test_segments_that_pause_for_a_log_only_go_on_with_the_watch_s_plan() -> None:
    # train.log_every_steps=16 in an epoch of 64: segments of 16, one stretch for the watch
    ctx = DistContext(0, 1, 0, torch.device("cpu"), "gloo")
    limit = TimeLimit(ctx, True, 5.0, deadline=time.monotonic() + 3600)
    limit.start_epoch(0, 64)
    assert not limit.should_stop(0) and limit.next_check == 1  # no step time yet: one step
    time.sleep(0.01)
    assert not limit.should_stop(1) and limit.next_check == 64  # the stretch fits: no look
    measured = limit.estimates.step_s
    for first in (16, 32, 48):  # a log between: the plan goes on (no look, no collective)
        limit.start_epoch(first, 64 - first)
        assert limit.next_check == 64 and limit.estimates.step_s == measured
    limit.start_epoch(64, 64)  # a validation and a checkpoint between: look first
    assert limit.next_check == 64 and limit.stop_at == -1
    assert not limit.should_stop(64) and limit.next_check == 65


def test_squeue_time_left_is_read_in_all_its_forms() -> None:
    assert parse_time_left("0:59\n") == 59
    assert parse_time_left("1:02:03") == 3723
    assert parse_time_left("2-01:00:00") == 2 * 86_400 + 3600
    assert parse_time_left("UNLIMITED") is None
    assert parse_time_left("NOT_SET") is None
    assert parse_time_left("") is None


def test_squeue_is_asked_for_this_job_alone() -> None:
    # An array element may run under the array's own job id, which names every element.
    element = {"SLURM_JOB_ID": "5", "SLURM_ARRAY_JOB_ID": "5", "SLURM_ARRAY_TASK_ID": "1"}
    assert squeue_job_id(element) == "5_1"
    assert squeue_job_id({"SLURM_JOB_ID": "7"}) == "7"
    assert squeue_job_id({}) is None


@pytest.fixture(scope="module")
def dataset(tmp_path_factory: pytest.TempPathFactory) -> DatasetRef:
    return write_dataset(tmp_path_factory.mktemp("data") / "ds", n_train=12288, n_val=256)


def _spec(dataset: DatasetRef, out: Path, **train: object) -> TrainJobSpec:
    settings: dict[str, object] = {
        "model": "resnet",
        "width": 16,
        "time_limit_margin_s": 5.0,
        **train,
    }
    cfg = TrainConfig(epochs=2, batch_size=64, precision="fp32", device="cpu", **settings)
    return TrainJobSpec(train=cfg, dataset=dataset, out_dir=out, max_requeues=0)


def _executor(folder: Path, limit_s: float | None, ranks: int = 2) -> submitit.Executor:
    executor = make_executor(ClusterConfig(ranks_per_node=ranks, timeout_min=10), folder)
    if limit_s is not None:
        executor.update_parameters(timeout_min=limit_s / 60, signal_delay_s=2)
    return executor


@pytest.mark.services
@pytest.mark.timeout(600)
def test_a_job_longer_than_its_time_limit_ends_as_one_without(
    dataset: DatasetRef, tmp_path: Path
) -> None:
    lines: list[str] = []
    spec = _spec(dataset, tmp_path / "limited")
    # 96 steps an epoch of at least 0.35 s each (67 s in all): an epoch outlasts what an
    # attempt of 40 s has left after its start-up, the margin (5 s) and the signal's delay
    # (2 s), on a fast machine too, so the run takes three attempts or more; 40 s leaves a
    # loaded machine's start-up room before the watch runs.
    job = _executor(tmp_path / "jobs-limited", 40).submit(SlowSteps(spec, 0.35))
    ref = wait_for_job(job, lines.append)
    assert isinstance(ref, CheckpointRef)
    stops = [ln for ln in lines if "checkpointing at step" in ln]
    resumed = [ln for ln in lines if " continues from step " in ln]
    # More requeues than spec.max_requeues (0): those that made progress do not count.
    assert len(resumed) >= 2, "\n".join(lines)
    assert len(stops) == len(resumed)
    assert any(", batch " in ln for ln in resumed)  # continued inside an epoch

    plain = _spec(dataset, tmp_path / "plain")
    assert isinstance(wait_for_job(_executor(tmp_path / "jobs-plain", None).submit(
        TrainingJob(plain)), lambda line: None), CheckpointRef)  # fmt: skip

    got = load_state(latest_checkpoint(spec.out_dir / "checkpoints"))  # type: ignore[arg-type]
    want = load_state(latest_checkpoint(plain.out_dir / "checkpoints"))  # type: ignore[arg-type]
    assert (got["epoch"], got["step"]) == (want["epoch"], want["step"])
    for name, tensor in want["model"].items():
        torch.testing.assert_close(got["model"][name], tensor, rtol=0, atol=0, msg=name)
    for a, b in zip(got["history"], want["history"], strict=True):
        assert _untimed(a) == _untimed(b)


@pytest.mark.services
@pytest.mark.timeout(300)
def test_attempts_without_progress_fail_after_max_requeues(
    dataset: DatasetRef, tmp_path: Path
) -> None:
    # A margin larger than the limit: every attempt stops before its first step.
    spec = _spec(dataset, tmp_path / "run", time_limit_margin_s=3600)
    spec = spec.model_copy(update={"max_requeues": 1})
    lines: list[str] = []
    job = _executor(tmp_path / "jobs", 60).submit(TrainingJob(spec))
    with pytest.raises(JobError) as failed:
        wait_for_job(job, lines.append)
    message = str(failed.value)
    assert "2 attempts in a row reached their time limit without a new checkpoint" in message
    assert "cluster.max_requeues=1" in message
    assert sum("attempt 2 continues from step 0" in ln for ln in lines) == 1
    assert latest_checkpoint(spec.out_dir / "checkpoints") is None  # nothing saved at step 0


def test_a_checkpoint_inside_an_epoch_sorts_between_the_epochs_around_it(tmp_path: Path) -> None:
    for epoch, batches in ((3, 0), (3, 40), (3, 7)):
        save_checkpoint({"epoch": epoch, "epoch_batches": batches, "step": 0}, tmp_path)
    newest = checkpoints(tmp_path)
    assert [p.name for p in newest] == ["epoch-000003+000040.pt", "epoch-000003+000007.pt"]
    assert checkpoint_epoch(newest[0]) == 3  # epochs done, for the progress artifact
    save_checkpoint({"epoch": 4, "epoch_batches": 0, "step": 0}, tmp_path)
    assert [p.name for p in checkpoints(tmp_path)] == ["epoch-000004.pt", "epoch-000003+000040.pt"]


_SAVE_DURING_SIGNAL = """
import os, signal, sys, time
import torch
from trainflow.tasks.train.distributed import DistContext
from trainflow.tasks.train.limits.time_limit import TimeLimit, hold_limit_signal, requeue_now

def acting(signum, frame):  # stands for submitit's handler: requeue, then exit
    print("requeued", flush=True)
    os.kill(os.getpid(), signal.SIGUSR2)  # the held signal's timer fires meanwhile
    time.sleep(0.2)
    sys.exit(0)

signal.signal(signal.SIGUSR2, acting)
ctx = DistContext(0, 1, 0, torch.device("cpu"), None)
limit = TimeLimit(ctx, True, 10.0)
limit.limit_at = time.monotonic() + 30  # the limit near, the deadline just passed: the
limit.deadline = time.monotonic() - 1  # planned checkpoint is being saved
hold_limit_signal(limit, 20.0)
os.kill(os.getpid(), signal.SIGUSR2)  # the limit's signal, during the save
time.sleep(0.2)
print("saved", flush=True)
requeue_now(True)
"""


def test_a_limit_signal_waits_for_the_planned_save_and_the_attempt_requeues_once() -> None:
    # The limit's requeue signal while rank 0 saves its planned checkpoint (past its
    # deadline): the save ends, then the job's own requeue acts; a signal that comes while
    # submitit's handler requeues is dropped (a second `scontrol requeue` would fail the job).
    out = subprocess.run(
        [sys.executable, "-c", _SAVE_DURING_SIGNAL], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr[-2000:]
    lines = [ln for ln in out.stdout.splitlines() if ln in ("saved", "requeued")]
    assert lines == ["saved", "requeued"], out.stdout
