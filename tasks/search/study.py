"""The Optuna study of a search: storage, sampler, pruner, and the trial budget.

Every process of a search (the flow, each array task) opens the study from a `StudyRef`: the
sampler and pruner are not stored in the database, so each builds them from their names.
"""

import copy
import math
import uuid
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict

from trainflow.errors import ConfigError
from trainflow.tasks.search.config import SearchConfig
from trainflow.tasks.search.space import Param, grid_values, parse_space

FINISHED = ("COMPLETE", "PRUNED")
"""Trial states that count as done."""
ORIGIN_ATTR = "failed_trial"
"""System attribute RetryHeartbeatStaleTrialCallback sets on a retry: its first try's number."""
HANDED_ATTR = "handed_over_from"
"""System attribute of a trial that continues one handed over at its task's requeue
(hand_over): that trial's number."""
TASK_ATTR = "task"
"""User attribute of a trial: the id of the array task that runs it, set first thing (a task
that dies before its trial's first heartbeat is found by it: tasks.search.array)."""
OVER_BUDGET_ATTR = "over_budget"
"""User attribute of a trial asked for when the budget was already spent (two tasks asked at
the same moment): it fails at once, trains nothing and counts for nothing."""


class StudyRef(BaseModel):
    """Everything a process needs to open the search's study; small and picklable."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    storage: str
    """SQLAlchemy URL of the study's database."""
    name: str
    """The study's name."""
    direction: Literal["maximize", "minimize"]
    """Whether the metric is maximised or minimised (the objective's direction for it)."""
    metric: str
    """The validation metric reported every epoch and optimised (val_accuracy)."""
    space: list[Param]
    """What the sampler draws."""
    trials: int
    """The budget: distinct trials (a retry is its first try's) the study runs in all."""
    sampler: str
    """tpe | grid | random."""
    pruner: str
    """asha | median | none."""
    seed: int | None = None
    """The sampler's seed."""
    heartbeat_interval_s: int = 10
    """How often a running trial's process records a heartbeat."""
    grace_period_s: int = 60
    """A trial without a heartbeat this long is failed (and retried)."""
    max_retry: int = 3
    """Retries of a trial that went stale."""


def make_ref(
    cfg: SearchConfig, workdir: Path, executor: str, name: str, metric: str, higher_is_better: bool
) -> StudyRef:
    """The study of `cfg` for a pipeline named `name`: ConfigError for a storage that Slurm
    nodes could not share."""
    storage = cfg.storage or f"sqlite:///{(workdir / 'optuna.db').resolve()}"
    if executor == "slurm" and storage.startswith("sqlite"):
        raise ConfigError(
            f"--storage {storage}: a Slurm search needs a database every node reaches (SQLite "
            "locks and corrupts on shared file systems); pass e.g. "
            "--storage postgresql+psycopg://user:password@host/db"
        )
    params = parse_space(cfg.space)
    trials = cfg.trials
    if cfg.sampler == "grid":  # ConfigError for a float range; the grid's size caps the budget
        trials = min(trials, math.prod(len(v) for v in grid_values(params).values()))
    return StudyRef(
        storage=storage,
        name=cfg.study or f"{name}-search",
        direction="maximize" if higher_is_better else "minimize",
        metric=metric,
        space=params,
        trials=trials,
        sampler=cfg.sampler,
        pruner=cfg.pruner,
        seed=cfg.seed,
        heartbeat_interval_s=cfg.heartbeat_interval_s,
        grace_period_s=cfg.grace_period_s,
        max_retry=cfg.max_retry,
    )


def open_storage(ref: StudyRef) -> Any:
    """The RDB storage with heartbeats: a trial whose process stops beating for
    grace_period_s is failed and retried (RetryFailedTrialCallback), its intermediate values
    kept, when any process next asks the study for a trial."""
    import optuna

    if ref.storage.startswith("sqlite"):
        Path(ref.storage.removeprefix("sqlite:///")).parent.mkdir(parents=True, exist_ok=True)
    # Several processes write a local SQLite study: wait for a lock rather than fail at once.
    engine = {"connect_args": {"timeout": 60}} if ref.storage.startswith("sqlite") else {}
    quiet_optuna()
    return optuna.storages.RDBStorage(
        ref.storage,
        engine_kwargs=engine,
        heartbeat_interval=ref.heartbeat_interval_s,
        grace_period=ref.grace_period_s,
        heartbeat_stale_trial_callback=retry_callback(ref),
    )


def retry_callback(ref: StudyRef) -> Any:
    """Optuna's retry of a failed trial: queued again (WAITING) with its parameters and
    intermediate values, at most max_retry times."""
    import optuna

    return optuna.storages.RetryHeartbeatStaleTrialCallback(
        max_retry=ref.max_retry, inherit_intermediate_values=True
    )


def fail_and_retry(study: Any, ref: StudyRef, number: int) -> bool:
    """Fail trial `number`, known lost, and queue its retry as a stale heartbeat would; False
    when it had ended meanwhile."""
    import optuna
    from optuna.trial import TrialState

    try:
        study.tell(number, state=TrialState.FAIL)
    except (RuntimeError, ValueError, optuna.exceptions.UpdateFinishedTrialError):
        return False
    # A copy, as Optuna's fail_stale_trials hands it: the callback appends to its attributes.
    retry_callback(ref)(study, copy.deepcopy(frozen(study, number)))
    return True


def quiet_optuna() -> None:
    """Optuna's experimental-feature warnings (heartbeats, stale-trial retries) and its INFO
    lines stay out of the search's logs: the search prints its own lines."""
    import warnings

    import optuna

    warnings.filterwarnings("ignore", category=optuna.exceptions.ExperimentalWarning)
    optuna.logging.set_verbosity(optuna.logging.WARNING)


def probe_storage(ref: StudyRef) -> None:
    """Open the storage and write to it (a study created and deleted): ConfigError naming
    the URL and the reason when it cannot be reached or written."""
    import optuna

    shown = _hide_password(ref.storage)
    try:
        storage = open_storage(ref)
        name = f"trainflow-probe-{uuid.uuid4().hex[:12]}"
        optuna.create_study(storage=storage, study_name=name)
        optuna.delete_study(study_name=name, storage=storage)
    except Exception as exc:
        reason = str(exc).strip().splitlines()[0][:300] if str(exc).strip() else type(exc).__name__
        raise ConfigError(
            f"--storage {shown} cannot be reached or written ({reason}); check the URL, the "
            "server and its user's rights (docs/search.md)"
        ) from None


def _hide_password(url: str) -> str:
    """The URL with its password replaced by ***."""
    head, at, tail = url.rpartition("@")
    if not at or "://" not in head:
        return url
    scheme, _, creds = head.partition("://")
    user, colon, _ = creds.partition(":")
    return f"{scheme}://{user}{':***' if colon else ''}@{tail}"


def make_sampler(ref: StudyRef, seed: int | None = None) -> Any:
    """The sampler `ref` names, seeded with `seed` (default: the search's own)."""
    import optuna

    seed = ref.seed if seed is None else seed
    if ref.sampler == "grid":
        return optuna.samplers.GridSampler(grid_values(ref.space), seed=seed)
    if ref.sampler == "random":
        return optuna.samplers.RandomSampler(seed=seed)
    return optuna.samplers.TPESampler(seed=seed)


def task_seed(ref: StudyRef, stream: int, task: int, attempt: int) -> int | None:
    """The sampler seed of one array task's attempt.

    Every task builds a sampler of its own: with the search's seed in each, all tasks (and
    every later run of the same study) would draw the same sequence of points. Mixing in the
    study's size when the array was submitted (`stream`: a later run continues where the
    earlier ones stopped), the task's index in its array and its attempt (a requeued task
    draws anew) gives each its own sequence, and the same ones again for the same search.
    The grid sampler keeps the search's seed: it maps trial numbers to points through an
    order shuffled by the seed, which every task must share to cover the grid once.
    """
    if ref.seed is None or ref.sampler == "grid":
        return ref.seed
    import numpy as np

    return int(np.random.SeedSequence([ref.seed, stream, task, attempt]).generate_state(1)[0])


def make_pruner(ref: StudyRef) -> Any:
    """The pruner `ref` names: asynchronous successive halving (rungs at 1, 4, 16... epochs),
    the median rule (after 2 trials), or none.

    Successive halving lets a trial past a rung when its value there is in the best quarter
    of the values trials had there (reduction factor 4, Optuna's own default), the first
    trial's values included (min_resource=1; "auto" waits for a complete trial and leaves the
    first one's values out). Chosen on P11 (docs/performance.md: a 16-point grid of the demo's
    resnet, 6 epochs), whose measured curves replayed in 201 orders kept the grid's best
    within 0.5 points in every order for a median 36.5% of its epochs, and met its goal (also
    at most 40% of the epochs) in 67% of them. Reduction factor 3 (rungs at 1, 3, 9) pruned
    the best in 24% of the orders: epoch 3 is this data's noisiest (later-best trials dip
    there); "auto" with factor 4 kept the best but spent a median 40.6%.
    """
    import optuna

    if ref.pruner == "asha":
        return optuna.pruners.SuccessiveHalvingPruner(min_resource=1, reduction_factor=4)
    if ref.pruner == "median":
        return optuna.pruners.MedianPruner(n_startup_trials=2, n_warmup_steps=0)
    return optuna.pruners.NopPruner()


def open_study(ref: StudyRef, seed: int | None = None) -> Any:
    """The study, created the first time, continued after; its sampler seeded with `seed`
    (default: the search's seed; an array task passes its own, `task_seed`)."""
    import optuna

    return optuna.create_study(
        storage=open_storage(ref),
        study_name=ref.name,
        direction=ref.direction,
        sampler=make_sampler(ref, seed),
        pruner=make_pruner(ref),
        load_if_exists=True,
    )


def origin(trial: Any) -> int:
    """The number of a trial's first try (itself unless it is a retry); `trial` frozen."""
    return int(trial.system_attrs.get(ORIGIN_ATTR, trial.number))


def frozen(study: Any, number: int) -> Any:
    """The stored (frozen) trial `number` of `study`, system attributes included."""
    return next(t for t in study.get_trials(deepcopy=False) if t.number == number)


def _counted(study: Any, below: int | None = None) -> set[int]:
    """First tries' numbers of the trials that count (numbered below `below` if given)."""
    return {
        origin(t)
        for t in study.get_trials(deepcopy=False)
        if not t.user_attrs.get(OVER_BUDGET_ATTR) and (below is None or t.number < below)
    }


def budget_left(study: Any, trials: int) -> int:
    """Trials not yet started within the budget: `trials` minus the distinct first tries
    (finished, running, waiting or failed: a retry is never counted twice)."""
    return trials - len(_counted(study))


def over_budget(study: Any, trial: Any, trials: int) -> bool:
    """Whether a new `trial` (frozen) came after the budget was spent: trials numbered below
    it already fill it (tasks that ask at the same moment get consecutive numbers, so the
    lowest win)."""
    return origin(trial) == trial.number and len(_counted(study, trial.number)) >= trials


def waiting(study: Any) -> bool:
    """Whether a trial waits to be run (a retry of one whose task died)."""
    from optuna.trial import TrialState

    return bool(study.get_trials(deepcopy=False, states=(TrialState.WAITING,)))


def hand_over(ref: StudyRef, number: int) -> None:
    """Trial `number`, running in a task that is being requeued (a time limit, a preemption):
    failed, and queued again at once as the same trial (its values, intermediate values and
    first try's number), so the requeued task, or any other, continues it from its checkpoint
    without waiting for its heartbeat to go stale. Not a retry: it does not count against
    max_retry, so a trial runs to its end across as many requeues as it needs."""
    import optuna
    from optuna.trial import TrialState

    study = open_study(ref)
    trial = frozen(study, number)
    study.tell(number, state=TrialState.FAIL)
    study.add_trial(
        optuna.trial.create_trial(
            state=TrialState.WAITING,
            params=trial.params,
            distributions=trial.distributions,
            user_attrs=trial.user_attrs,
            system_attrs={
                **trial.system_attrs,
                ORIGIN_ATTR: origin(trial),
                HANDED_ATTR: number,
            },
            intermediate_values=trial.intermediate_values,
        )
    )
