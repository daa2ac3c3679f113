"""The search's array task: asks the study for a trial, trains it, tells the outcome, again.

Every rank of an array task runs `TrialWorker`; rank 0 alone talks to the study. It asks for a
trial inside Optuna's own `study.optimize` (one trial a call: the heartbeat thread, stale-trial
retries and the TrialPruned bookkeeping are Optuna's) and hands the trial's training spec to
the other ranks through a numbered file in the task's folder; all ranks then train it as any
TrainingJob. After every epoch rank 0 reports the validation metric (train.monitor's) and asks
the pruner; its answer is broadcast, so every rank stops at the same epoch. Early stopping
(train.early_stop_patience) asks after the pruner, after the same validation: a trial it stops
returns its best checkpoint and is COMPLETE with that validation's value. The task pulls
trials until the budget is spent, so a pruned trial frees its slot at once.

A trial's out_dir is keyed by its first try's number: a retry (its task was lost) resumes
from that trial's last checkpoint, with the intermediate values it reported. A task requeued
at a time limit or a preemption queues its trial again at once (`study.hand_over`), and counts
its attempts without progress (no trial's checkpoint advanced) against cluster.max_requeues as
a single training job does (tasks.train.limits.limit_requeue).
"""

import json
import os
import time
from pathlib import Path
from typing import Any

import submitit
from pydantic import BaseModel, ConfigDict

from trainflow.errors import JobError
from trainflow.tasks.search.study import (
    OVER_BUDGET_ATTR,
    TASK_ATTR,
    StudyRef,
    budget_left,
    frozen,
    hand_over,
    open_study,
    origin,
    over_budget,
    task_seed,
    waiting,
)
from trainflow.tasks.search.trial_runs import close_trial_run, open_trial_run
from trainflow.tasks.train.config import TrainConfig
from trainflow.tasks.train.distributed import DistContext, release_kept
from trainflow.tasks.train.job import TrainingJob, TrainJobSpec
from trainflow.tasks.train.limits.limit_requeue import check_stalled, count_stalled, made_progress

CHECKPOINT_ATTR = "checkpoint"
"""User attribute of a complete trial: its best checkpoint (a CheckpointRef as JSON)."""
ASSIGN_WAIT_S = 600.0
"""How long a rank other than 0 waits for rank 0 to hand it the next trial (rank 0 only asks
the study in between)."""


class SearchJob(BaseModel):
    """What every array task of a search gets; small and picklable."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    study: StudyRef
    """The study to pull trials from."""
    base: TrainJobSpec
    """The training every trial starts from; out_dir is the search's trials folder."""
    parent_run_id: str | None = None
    """The search's MLflow parent run: each trial's run is its child."""
    stream: int = 0
    """Trials the study held when this array was submitted: with the search's seed, the
    task's index and its attempt, it seeds the task's sampler (study.task_seed)."""


def trial_train(base: TrainConfig, params: dict[str, Any]) -> TrainConfig:
    """The base training config with a trial's train.* values (validated again)."""
    tree = base.model_dump()
    for key, value in params.items():
        node = tree
        *parents, leaf = key.removeprefix("train.").split(".")
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
    return TrainConfig.model_validate(tree)


def suggest(trial: Any, study: StudyRef) -> dict[str, Any]:
    """The trial's values of the space (a retry's are fixed: Optuna returns them)."""
    out: dict[str, Any] = {}
    for p in study.space:
        if p.kind == "choice":
            out[p.key] = trial.suggest_categorical(p.key, list(p.choices))
        elif p.kind in ("int", "logint"):
            out[p.key] = trial.suggest_int(p.key, int(p.low or 0), int(p.high or 0), log=p.log)
        else:
            out[p.key] = trial.suggest_float(
                p.key, float(p.low or 0), float(p.high or 0), log=p.log
            )
    return out


class TrialWorker(submitit.helpers.Checkpointable):
    """One array task of a search (every rank runs it); rank 0 returns the numbers of the
    trials this task ran. `stalled`: the attempts before this one in a row that reached a
    time limit without a trial's new checkpoint; `attempt`: this task's starts before this one
    (a requeued task's sampler draws anew)."""

    def __init__(self, job: SearchJob, stalled: int = 0, attempt: int = 0) -> None:
        self.job = job
        self.stalled = stalled
        self.attempt = attempt

    def checkpoint(self, *args: Any, **kwargs: Any) -> submitit.helpers.DelayedSubmission:
        """On a time limit or preemption (submitit calls this in rank 0): the task again, as
        its next attempt, and the trial in training queued again for it (`hand_over`). An
        attempt in which a trial wrote a new checkpoint made progress; the others count
        against cluster.max_requeues as a single job's do: the trial in training is asked
        (tasks.train.limits.limit_requeue), StalledAtTimeLimit past the bound."""
        leader: _Leader | None = getattr(self, "_leader", None)
        if leader is None:  # stopped before it asked for a trial
            stalled = check_stalled(self.stalled + 1, self.job.base.max_requeues, -1)
        else:
            stalled = leader.count_stalled()
            if leader.number is not None:
                hand_over(self.job.study, leader.number)
                print(f"trial {leader.number}: queued again for the requeued task", flush=True)
        again = TrialWorker(self.job, stalled, self.attempt + 1)
        return submitit.helpers.DelayedSubmission(again, *args, **kwargs)

    def __call__(self, index: int = 0) -> list[int]:
        """Pull and train trials until the study's budget is spent (`index`: this task's
        place in the array, for its log)."""
        from trainflow.tasks.train.rendezvous import submitit_layout

        layout = submitit_layout()
        folder = _task_folder(self.job.base.out_dir)
        if layout is None or layout.rank == 0:
            print(f"search task {index}: pulling trials of study {self.job.study.name}", flush=True)
            self._leader = _Leader(self.job, folder, layout.file if layout else None, self.stalled)
            return self._leader.run(index, self.attempt)
        _follow(folder)
        return []


def _task_folder(trials: Path) -> Path:
    """This task's hand-over folder (a requeued attempt gets a new one)."""
    env = submitit.JobEnvironment()
    restart = os.environ.get("SLURM_RESTART_COUNT", "0")
    folder = trials / "tasks" / f"{env.job_id}-{restart}"
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def _publish(folder: Path, seq: int, message: dict[str, Any]) -> None:
    """Hand trial `seq` (or the end) to the other ranks, atomically."""
    tmp = folder / f"{seq}.json.tmp"
    tmp.write_text(json.dumps(message))
    os.replace(tmp, folder / f"{seq}.json")


class _OverBudget(Exception):
    """A trial asked for after the budget was spent: failed at once, not trained."""


class _Leader:
    """Rank 0's side: the study, the trials' runs, the hand-over to the other ranks."""

    def __init__(
        self, job: SearchJob, folder: Path, rendezvous: Path | None, stalled: int = 0
    ) -> None:
        self.job, self.folder, self.rendezvous = job, folder, rendezvous
        self.seq = 0
        self.ran: list[int] = []
        self.stalled = stalled
        """Attempts before this one in a row without progress (the task's)."""
        self.training: TrainingJob | None = None
        """The trial in training now, if any, and its number."""
        self.number: int | None = None
        self.progressed = False
        """Whether a trial of this attempt wrote a new checkpoint."""

    def count_stalled(self) -> int:
        """At the requeue signal: attempts in a row, this one included, without progress;
        StalledAtTimeLimit past cluster.max_requeues."""
        if self.progressed:
            return 0
        if self.training is None:  # between trials, none of which checkpointed
            return check_stalled(self.stalled + 1, self.job.base.max_requeues, -1)
        return count_stalled(self.training)  # the trial counts as a single job

    def run(self, index: int, attempt: int) -> list[int]:
        """Trials until the budget is spent; the sampler seeded for task `index`'s `attempt`."""
        import optuna

        ref = self.job.study
        study = open_study(ref, task_seed(ref, self.job.stream, index, attempt))
        try:
            while True:
                optuna.storages.fail_stale_trials(study)  # lost tasks' trials: retries queued
                if budget_left(study, ref.trials) <= 0 and not waiting(study):
                    break
                study.optimize(self._objective, n_trials=1, catch=(Exception,))
        finally:
            _publish(self.folder, self.seq, {"stop": True})
        return self.ran

    def _objective(self, trial: Any) -> float:
        import optuna

        ref, base = self.job.study, self.job.base
        trial.set_user_attr(TASK_ATTR, str(submitit.JobEnvironment().job_id))  # first: see it
        stored = frozen(trial.study, trial.number)
        if over_budget(trial.study, stored, ref.trials):
            trial.set_user_attr(OVER_BUDGET_ATTR, True)
            raise _OverBudget(f"trial {trial.number} came after the budget was spent")
        params = suggest(trial, ref)
        number = origin(stored)
        self.ran.append(trial.number)
        spec = base.model_copy(
            update={
                "train": trial_train(base.train, params),
                "out_dir": base.out_dir / f"trial-{number}",
            }
        )
        uri, parent = spec.tracking_uri, self.job.parent_run_id
        run_id = open_trial_run(uri, parent, trial, number, spec.train) if uri and parent else None
        spec = spec.model_copy(update={"run_id": run_id})
        print(f"trial {trial.number}: {params} in {spec.out_dir}", flush=True)
        if self.rendezvous is not None:  # the last trial's store is gone: no rank may meet it
            self.rendezvous.unlink(missing_ok=True)
        _publish(self.folder, self.seq, {"spec": spec.model_dump(mode="json")})
        self.seq += 1
        hook = _Pruning(trial, ref.metric)
        self.training, self.number = TrainingJob(spec, hook, stalled=self.stalled), trial.number
        try:
            ref_ = _train(self.training, run_id)
        except Exception as exc:  # Optuna fails the trial (catch=Exception); the next follows
            if run_id and uri:
                close_trial_run(uri, run_id, "failed", "FAILED")
            raise JobError(f"trial {trial.number} failed: {exc}") from exc
        except KeyboardInterrupt:  # the search was cancelled: Optuna fails the trial
            if run_id and uri:
                close_trial_run(uri, run_id, "killed (cancelled)", "KILLED")
            raise
        finally:
            self.progressed = self.progressed or made_progress(self.training)
            self.training = self.number = None
        if hook.pruned_at:
            if run_id and uri:
                close_trial_run(uri, run_id, f"pruned at epoch {hook.pruned_at}", "FINISHED")
            raise optuna.TrialPruned(f"pruned at epoch {hook.pruned_at}")
        if ref_ is None or ref.metric not in ref_.metrics:
            raise JobError(f"trial {trial.number} reported no {ref.metric}")
        trial.set_user_attr(CHECKPOINT_ATTR, ref_.model_dump(mode="json"))
        value = float(ref_.metrics[ref.metric])
        if run_id and uri:
            close_trial_run(uri, run_id, "complete", "FINISHED")
        return value


def _train(job: TrainingJob, run_id: str | None) -> Any:
    """Train the trial on this task's ranks; rank 0's journal relayed to the trial's run."""
    from trainflow.tasks.tracking.relay import relaying

    release_kept()  # the last trial's model, kept past its end (see release_kept)
    spec = job.spec
    with relaying(spec.out_dir, spec.tracking_uri, run_id, lambda line: print(line, flush=True)):
        return job()


class _Pruning:
    """Rank 0's epoch_end: report the metric, ask the pruner, broadcast the answer."""

    def __init__(self, trial: Any, metric: str) -> None:
        self.trial, self.metric = trial, metric
        self.pruned_at = 0

    def __call__(self, epoch: int, metrics: dict[str, float], dist: DistContext) -> bool:
        value = metrics.get(self.metric)
        if value is not None:
            self.trial.report(float(value), epoch)
        stop = _agree(value is not None and self.trial.should_prune(), dist)
        if stop:
            self.pruned_at = epoch
            print(f"trial {self.trial.number}: pruned after epoch {epoch}", flush=True)
        return stop


def _follower_hook(epoch: int, metrics: dict[str, float], dist: DistContext) -> bool:
    """The other ranks' epoch_end: take rank 0's decision."""
    return _agree(False, dist)


def _agree(decision: bool, dist: DistContext) -> bool:
    """Rank 0's decision on every rank: a broadcast over the whole world (not the metric
    sums' all-reduce, which under a mesh covers the data-parallel ranks only)."""
    if dist.world_size == 1:
        return decision
    import torch
    import torch.distributed

    flag = torch.tensor([1.0 if decision and dist.is_main else 0.0], device=dist.device)
    torch.distributed.broadcast(flag, src=0)
    return bool(flag.item() > 0)


def _follow(folder: Path) -> None:
    """A rank other than 0: train each trial rank 0 hands over, until it says stop."""
    seq = 0
    while True:
        message = _wait_for(folder / f"{seq}.json")
        if message.get("stop"):
            return
        spec = TrainJobSpec.model_validate(message["spec"])
        release_kept()
        try:
            TrainingJob(spec, _follower_hook)()
        except Exception as exc:  # rank 0 fails the trial; this rank goes on with the next
            print(f"trial in {spec.out_dir} failed on this rank: {exc}", flush=True)
        seq += 1


def _wait_for(path: Path) -> dict[str, Any]:
    deadline = time.monotonic() + ASSIGN_WAIT_S
    while time.monotonic() < deadline:
        if path.exists():
            loaded: dict[str, Any] = json.loads(path.read_text())
            return loaded
        time.sleep(0.2)
    raise JobError(f"rank 0 handed over no trial in {ASSIGN_WAIT_S:.0f} s ({path} missing)")
