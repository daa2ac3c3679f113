"""The training job run for real through submitit: 2 DDP ranks on the local executor.

Nothing is mocked: each test submits real processes (gloo on CPU) and watches them with
cluster.jobs.wait_for_job, as the flow does.
"""

import copy
import json
import re
import signal
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import cloudpickle
import psutil
import pytest
import submitit
import torch

from tests.unit.datasets import write_dataset
from trainflow.cluster.config import ClusterConfig
from trainflow.cluster.executor import make_executor
from trainflow.cluster.jobs import wait_for_job
from trainflow.errors import ConfigError, JobError
from trainflow.tasks.hashing import sha256_file
from trainflow.tasks.objectives import make_objective
from trainflow.tasks.preprocess.ref import DatasetRef, dataset_spec
from trainflow.tasks.train.cadence import Due
from trainflow.tasks.train.checkpointing.checkpoint import (
    host_copy,
    latest_checkpoint,
    training_state,
)
from trainflow.tasks.train.checkpointing.recorder import EpochRecorder
from trainflow.tasks.train.config import TrainConfig
from trainflow.tasks.train.data import (
    Split,
    eval_batches,
    load_split_to,
    rank_batches,
)
from trainflow.tasks.train.distributed import DistContext, distributed
from trainflow.tasks.train.job import TrainingJob, TrainJobSpec
from trainflow.tasks.train.loop import evaluate_split
from trainflow.tasks.train.models import ReferenceCNN
from trainflow.tasks.train.monitor import Verdict
from trainflow.tasks.train.precision import (
    PrecisionPolicy,
    cpu_supports_bf16,
    device_supports_bf16,
)
from trainflow.tasks.train.recipe import Recipe
from trainflow.tasks.train.ref import CheckpointRef
from trainflow.tasks.train.schedule import schedule_for

# The job processes cannot import this test module: ship its classes and functions by value.
cloudpickle.register_pickle_by_value(sys.modules[__name__])


@pytest.fixture(scope="module")
def dataset(tmp_path_factory: pytest.TempPathFactory) -> DatasetRef:
    return write_dataset(tmp_path_factory.mktemp("data") / "ds")


@pytest.fixture(autouse=True)
def _restore_torch_threads() -> Iterator[None]:
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def _spec(dataset: DatasetRef, out_dir: Path, epochs: int = 4, **train: object) -> TrainJobSpec:
    cfg = TrainConfig(epochs=epochs, batch_size=32, device="cpu", **train)
    return TrainJobSpec(train=cfg, dataset=dataset, out_dir=out_dir)


def _local(tmp_path: Path, ranks: int = 2) -> submitit.Executor:
    return make_executor(ClusterConfig(ranks_per_node=ranks, timeout_min=5), tmp_path / "jobs")


class _Rank1Breaks(Recipe):
    def segment(self) -> tuple[dict[str, float], Due]:
        if self.trainer.dist.rank == 1:
            raise ValueError("rank 1 broke on purpose")
        return super().segment()


class FailingRank1(TrainingJob):
    """Rank 1 breaks in its first epoch while rank 0 trains on."""

    recipe = _Rank1Breaks


@pytest.mark.services
def test_two_ranks_train_and_rank0_returns_the_best_checkpoint(
    dataset: DatasetRef, tmp_path: Path
) -> None:
    lines: list[str] = []
    job = _local(tmp_path).submit(TrainingJob(_spec(dataset, tmp_path / "run", precision="fp32")))
    ref = wait_for_job(job, lines.append, poll_s=0.2)

    assert isinstance(ref, CheckpointRef)
    assert ref.path.is_file() and sha256_file(ref.path) == ref.sha256
    history = json.loads(ref.history_path.read_text())
    assert [h["epoch"] for h in history] == [1, 2, 3, 4]
    assert history[0]["step"] == 4  # 256 samples / 2 ranks / batch 32: both ranks took part
    assert ref.metrics["val_accuracy"] == max(h["val_accuracy"] for h in history)
    assert ref.metrics["val_accuracy"] > 0.5  # chance is 0.25
    best = torch.load(ref.path, weights_only=True)
    ReferenceCNN(1, 4, 12, 12).load_state_dict(best["model"])  # saved without the DDP wrapper
    assert best["meta"]["train"]["precision"] == "fp32"
    assert any(line.startswith("[rank0] epoch 4/4 loss") for line in lines)
    assert not any(line.startswith("[rank1] epoch") for line in lines)


class _FirstEpochKept(Recipe):
    def observe(self, metrics: dict[str, float]) -> Verdict:
        verdict = super().observe(metrics)
        progress = self.progress
        progress.best_metric, progress.best_epoch = progress.history[0][self.monitor.metric], 1
        return verdict


class FirstEpochIsBest(TrainingJob):
    """Keeps epoch 1 as the best whatever later epochs score: the job's test pass must then
    load best.pt instead of testing the weights it ends with."""

    recipe = _FirstEpochKept


def _test_metrics(dataset: DatasetRef, weights: dict[str, torch.Tensor]) -> dict[str, float]:
    """The test split's metrics of `weights`, computed here in one process, in fp32."""
    model = ReferenceCNN(1, 4, 12, 12)
    model.load_state_dict(weights)
    objective = make_objective("classification", dataset_spec(dataset, "classification"))
    split = load_split_to(Path(dataset.path), "test", torch.device("cpu"))
    one = DistContext(0, 1, 0, torch.device("cpu"), None)
    policy = PrecisionPolicy("cpu", None, False, "fp32")
    return {
        f"test_{k}": v for k, v in evaluate_split(model, split, 64, policy, one, objective).items()
    }


@pytest.mark.services
@pytest.mark.parametrize("job_class", [TrainingJob, FirstEpochIsBest])
def test_the_job_tests_the_best_weights_as_training_ends(
    dataset: DatasetRef, tmp_path: Path, job_class: type[TrainingJob]
) -> None:
    """The run's first result (tasks.train.first_result): the best epoch's weights through the
    test split, in the job (2 ranks), said in one line by rank 0 and handed back. Trained in
    bf16 where this CPU runs it (an AVX2-only CPU refuses bf16), tested in fp32 either way."""
    lines: list[str] = []
    trained_in = "bf16" if device_supports_bf16(torch.device("cpu")) else "fp32"
    spec = _spec(dataset, tmp_path / "run", epochs=2, precision=trained_in)
    ref = wait_for_job(_local(tmp_path).submit(job_class(spec)), lines.append, poll_s=0.1)
    assert isinstance(ref, CheckpointRef)
    best = torch.load(ref.path, weights_only=True)["model"]
    expected = _test_metrics(dataset, best)
    assert ref.test_metrics == pytest.approx(expected, rel=1e-5)  # fp32, not the training bf16
    said = (
        f"[rank0] test accuracy {expected['test_accuracy']:.4f} (first result: epoch {ref.epoch}'s"
    )
    assert sum(line.startswith(said) for line in lines) == 1, lines
    if job_class is FirstEpochIsBest:  # best.pt, not the last epoch's weights, was tested
        assert ref.epoch == 1
        newest = latest_checkpoint(spec.out_dir / "checkpoints")
        assert newest is not None
        last = torch.load(newest, weights_only=True)
        assert _test_metrics(dataset, last["model"])["test_loss"] != pytest.approx(
            ref.test_metrics["test_loss"], rel=1e-5
        )


@pytest.mark.services
def test_a_failing_rank_fails_the_job_fast_with_its_traceback(
    dataset: DatasetRef, tmp_path: Path
) -> None:
    job = _local(tmp_path).submit(FailingRank1(_spec(dataset, tmp_path / "run", epochs=50)))
    start = time.monotonic()
    with pytest.raises(JobError) as failure:
        wait_for_job(job, lambda line: None, poll_s=0.2)
    assert time.monotonic() - start < 60  # the collective timeout is 5 minutes
    message = str(failure.value)
    assert "failed in rank 1" in message
    assert "ValueError: rank 1 broke on purpose" in message
    assert "in segment" in failure.value.detail  # the remote traceback, beside the error line


@pytest.mark.services
def test_a_preempted_job_requeues_and_resumes_from_its_checkpoint(
    dataset: DatasetRef, tmp_path: Path
) -> None:
    spec = _spec(dataset, tmp_path / "run", epochs=60)
    job = _local(tmp_path).submit(TrainingJob(spec))
    ranks = _wait_for_first_checkpoint(job, spec.out_dir / "checkpoints")
    for rank in ranks:  # what Slurm or the local controller does before a timeout
        rank.send_signal(signal.SIGUSR2)
    lines: list[str] = []
    ref = wait_for_job(job, lines.append, poll_s=0.2)

    assert isinstance(ref, CheckpointRef)
    assert any("resuming from" in line for line in lines)
    history = json.loads(ref.history_path.read_text())
    assert [h["epoch"] for h in history] == list(range(1, 61))


def _wait_for_first_checkpoint(job: submitit.Job, folder: Path) -> list[psutil.Process]:
    """The job's rank processes, once rank 0 has written a checkpoint."""
    deadline = time.monotonic() + 60
    while latest_checkpoint(folder) is None:
        assert time.monotonic() < deadline and not job.done(), "no checkpoint was written"
        time.sleep(0.05)
    return psutil.Process(job._process.pid).children()  # type: ignore[attr-defined]


def _print_and_sleep() -> None:
    print("started", flush=True)
    time.sleep(120)


@pytest.mark.services
def test_interrupting_the_watcher_cancels_the_job(tmp_path: Path) -> None:
    job = _local(tmp_path).submit(_print_and_sleep)
    ranks: list[psutil.Process] = []

    def interrupt_at_first_output(line: str) -> None:
        ranks.extend(psutil.Process(job._process.pid).children())  # type: ignore[attr-defined]
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        wait_for_job(job, interrupt_at_first_output, poll_s=0.1)
    _gone, alive = psutil.wait_procs(ranks, timeout=10)
    assert len(ranks) == 2 and not alive


def _debug(tmp_path: Path) -> submitit.Executor:
    return make_executor(ClusterConfig(executor="debug", ranks_per_node=1), tmp_path / "jobs")


@pytest.mark.skipif(not cpu_supports_bf16(), reason="this CPU has no native bf16")
def test_bf16_trains_too(dataset: DatasetRef, tmp_path: Path) -> None:
    spec = _spec(dataset, tmp_path / "run", precision="bf16")
    ref = wait_for_job(_debug(tmp_path).submit(TrainingJob(spec)), print)
    assert isinstance(ref, CheckpointRef) and ref.metrics["val_accuracy"] > 0.5
    assert torch.load(ref.path, weights_only=True)["meta"]["train"]["precision"] == "bf16"


def test_a_failing_debug_job_raises_job_error_with_the_traceback(
    dataset: DatasetRef, tmp_path: Path
) -> None:
    missing = dataset.model_copy(update={"path": tmp_path / "missing"})
    spec = TrainJobSpec(train=TrainConfig(), dataset=missing, out_dir=tmp_path / "run")
    with pytest.raises(JobError, match=r"^debug job failed: DataError: no dataset at") as err:
        wait_for_job(_debug(tmp_path).submit(TrainingJob(spec)), print)
    assert "Traceback" not in str(err.value)  # one line; the traceback is the detail (--debug)
    assert re.search(r"(?s)Traceback.*DataError: no dataset at", err.value.detail)


def test_the_local_executor_gets_the_cluster_resources(tmp_path: Path) -> None:
    cfg = ClusterConfig(ranks_per_node=3, cpus_per_task=2, timeout_min=7)
    executor = make_executor(cfg, tmp_path)
    assert isinstance(executor, submitit.LocalExecutor)
    assert executor.parameters["tasks_per_node"] == 3
    assert executor.parameters["timeout_min"] == 7
    assert executor.parameters["gpus_per_node"] == 0


def _split(n: int) -> Split:
    return Split(torch.zeros(n, 1, 2, 2), torch.zeros(n, dtype=torch.int64))


def test_ranks_take_equal_disjoint_shares_of_one_shuffled_order() -> None:
    split = _split(103)
    shares = [torch.cat(rank_batches(split, 8, 0, 1, rank, 3)) for rank in range(3)]
    per_rank = [len(rank_batches(split, 8, 0, 1, rank, 3)) for rank in range(3)]
    assert [len(s) for s in shares] == [34, 34, 34] and len(set(per_rank)) == 1
    assert len(set(torch.cat(shares).tolist())) == 102  # disjoint; one sample left over


def test_the_data_order_depends_only_on_seed_and_epoch() -> None:
    split = _split(64)
    epoch1 = torch.cat(rank_batches(split, 16, 7, 1, 0, 1))
    assert torch.equal(epoch1, torch.cat(rank_batches(split, 16, 7, 1, 0, 1)))
    assert not torch.equal(epoch1, torch.cat(rank_batches(split, 16, 7, 2, 0, 1)))
    assert not torch.equal(epoch1, torch.cat(rank_batches(split, 16, 8, 1, 0, 1)))


def test_evaluation_sees_every_sample_once_across_ranks() -> None:
    split = _split(50)
    seen = torch.cat([torch.cat(eval_batches(split, 7, rank, 3)) for rank in range(3)])
    assert sorted(seen.tolist()) == list(range(50))


def test_the_default_learning_rate_decays_from_peak_to_zero() -> None:
    lr = schedule_for(TrainConfig(), 100).lr
    assert lr(0, 100, 0.1) == pytest.approx(0.1)
    assert lr(50, 100, 0.1) == pytest.approx(0.05)
    assert lr(100, 100, 0.1) == pytest.approx(0.0)


def test_a_plain_process_is_a_world_of_one_without_a_process_group() -> None:
    with distributed("auto") as ctx:
        assert (ctx.rank, ctx.world_size, ctx.backend) == (0, 1, None)
        assert not torch.distributed.is_initialized()
        assert ctx.device.type == ("cuda" if torch.cuda.is_available() else "cpu")


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without a GPU")
def test_asking_for_cuda_without_a_gpu_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match=r"train\.device=auto or cpu"), distributed("cuda"):
        pass


# --- epoch records on a background thread ------------------------------------------------


def test_the_recorder_writes_in_order_one_at_a_time() -> None:
    events: list[str] = []

    def record(name: str) -> Callable[[], None]:
        def write() -> None:
            events.append(f"start {name}")
            time.sleep(0.05)  # a slow disk: the next hand-off must wait for this one
            events.append(f"end {name}")

        return write

    with EpochRecorder() as recorder:
        for name in "abc":
            recorder.submit(record(name))
            events.append(f"handed {name}")
    assert events.index("end a") < events.index("handed b") and events[-1] == "end c"
    assert [e for e in events if e.startswith("start")] == ["start a", "start b", "start c"]


def test_a_failed_record_fails_the_next_hand_off() -> None:
    def fail() -> None:
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"), EpochRecorder() as recorder:
        recorder.submit(fail)
        recorder.submit(lambda: None)


def test_the_error_ending_the_job_is_not_hidden_by_a_failed_record() -> None:
    def fail() -> None:
        raise OSError("disk full")

    with pytest.raises(ValueError, match="the job's own error"), EpochRecorder() as recorder:
        recorder.submit(fail)
        raise ValueError("the job's own error")


def test_a_training_job_fails_when_its_checkpoints_cannot_be_written(
    dataset: DatasetRef, tmp_path: Path
) -> None:
    out = tmp_path / "run"
    out.mkdir()
    (out / "checkpoints").write_text("a file where the checkpoint folder should be")
    job = TrainingJob(_spec(dataset, out, epochs=3))
    with pytest.raises(FileExistsError):
        job()


def test_a_state_snapshot_does_not_follow_later_steps() -> None:
    torch.manual_seed(0)
    model = ReferenceCNN(1, 4, 12, 12)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", enabled=False)

    def step() -> None:
        opt.zero_grad()
        model(torch.randn(8, 1, 12, 12)).sum().backward()
        opt.step()

    step()
    snapshot = host_copy(training_state(model, opt, scaler, {"epoch": 1}))
    frozen = copy.deepcopy(snapshot)
    step()  # the next epoch trains on while the snapshot is written
    for part in ("model", "optimizer"):
        flat_now = _tensors(snapshot[part])
        assert flat_now and all(
            torch.equal(a, b) for a, b in zip(flat_now, _tensors(frozen[part]), strict=True)
        )
    assert not torch.equal(snapshot["model"]["fc.weight"], model.fc.weight)


def _tensors(obj: object) -> list[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, dict):
        return [t for v in obj.values() for t in _tensors(v)]
    if isinstance(obj, list | tuple):
        return [t for v in obj for t in _tensors(v)]
    return []
