"""SearchConfig: what `trainflow sweep --space` searches, how, and where the study lives."""

from typing import Any, Literal

from pydantic import Field

from trainflow.config_base import StrictModel


class SearchConfig(StrictModel):
    """A search over train.* keys: Optuna's sampler proposes, its pruner stops losing trials."""

    space: dict[str, str | list[Any]]
    """Key -> parameter text (``loguniform(1e-4,1e-1)``, ``int(16,128)``, ``choice(32,64)``)
    or a list of choices (tasks.search.space)."""
    trials: int = Field(16, ge=1, le=10_000)
    """Trials in the study's budget: trials already finished in the study count."""
    parallel: int = Field(2, ge=1, le=256)
    """Array tasks that train trials at once, each pulling the next trial when it is free."""
    sampler: Literal["tpe", "grid", "random"] = "tpe"
    """Optuna's TPESampler, GridSampler (choice and int keys only) or RandomSampler."""
    pruner: Literal["asha", "median", "none"] = "asha"
    """Optuna's SuccessiveHalvingPruner (asynchronous successive halving), MedianPruner, or
    no pruning."""
    storage: str | None = None
    """SQLAlchemy URL of the study's database; default: SQLite under the workdir (local
    executor only: a Slurm search needs a database every node reaches, e.g.
    postgresql+psycopg://user:password@host/db)."""
    study: str | None = None
    """Study name; default: the config's name plus "-search". The same name and storage
    continue the study: finished trials are kept and count towards `trials`."""
    seed: int | None = None
    """Seeds each array task's sampler (tasks.search.study.task_seed; None: not reproducible)."""
    heartbeat_interval_s: int = Field(10, ge=1)
    """How often a running trial tells the storage it is alive."""
    grace_period_s: int = Field(60, ge=2)
    """A running trial silent this long is failed and retried from its checkpoint."""
    max_retry: int = Field(3, ge=0)
    """Retries of a trial whose task died (preempted, lost) before it counts as failed."""
