"""train.parallel: how a job's ranks are laid out on a device mesh, and its check (no torch:
the config's validation and the preflight use it before anything imports torch).

Four dimensions, the innermost last (ranks next to each other share a node: put tensor
parallelism, which talks every layer, there; pipeline stages, which hand over activations
once per micro-batch, outermost, where the links may be slowest):

- pp: pipeline parallelism, the model's layers cut into `pp` stages in order, each rank
  holding one stage and passing activations (forward) and their gradients (backward) to its
  neighbours, micro-batch by micro-batch;
- dp_replicate: HSDP, full replicas of the sharded model, gradients all-reduced between them;
- dp_shard: FSDP2, parameters, gradients and optimizer state sharded;
- tp: tensor parallelism, each layer's weights split, every rank of a group computing part of
  every layer on the same batch (with sequence parallelism for the norms between them).

A rank's coordinates: tp = rank % tp; the data-parallel rank, (rank // tp) % (dp_replicate x
dp_shard), picks its batches (the tp ranks of one group, and the stages of one pipeline, take
the same ones); the stage, rank // (dp_replicate x dp_shard x tp). The sizes multiply to the
world size; one of them may be -1, "the rest of the world".
"""

import math
from dataclasses import dataclass

from pydantic import Field, model_validator

from trainflow.config_base import StrictModel
from trainflow.errors import ConfigError

DIMENSIONS = ("pp", "dp_replicate", "dp_shard", "tp")
"""The mesh's dimensions, outermost first."""


class ParallelConfig(StrictModel):
    """The mesh of a train.strategy=fsdp job: [train.parallel] in an experiment file."""

    pp: int = Field(1, ge=-1, le=65_536)
    """Pipeline stages the model's layers are cut into, in order (torch.distributed.pipelining,
    1F1B schedule): each rank holds and computes one stage's layers, so parameters and
    activations per rank shrink with the stages. The model's layers must divide by it, and it
    must name its cut (a method pp_split; the built-in transformer has one). Outermost: the
    stages exchange activations once per micro-batch, the least traffic of the dimensions.
    -1: the rest of the world."""
    pp_microbatches: int | None = Field(None, ge=1, le=65_536)
    """pp above 1: micro-batches each rank's batch is split into for the pipeline schedule
    (at least pp; train.batch_size must divide by it). More micro-batches, a smaller share of
    idle stages (the pipeline's bubble, (pp - 1) / (micro-batches + pp - 1) of a step), but
    smaller matrix products. Unset: pp."""

    dp_replicate: int = Field(1, ge=-1, le=65_536)
    """Replicas of the sharded model (HSDP: sharded within a replica, all-reduced between
    replicas; e.g. one replica per node). -1: the rest of the world."""
    dp_shard: int = Field(-1, ge=-1, le=65_536)
    """Ranks each parameter, gradient and optimizer state is sharded over (FSDP2). -1 (the
    default): the rest of the world."""
    tp: int = Field(1, ge=-1, le=65_536)
    """Ranks each layer is split over (tensor parallelism, with sequence parallelism for the
    norms): the model's attention heads, hidden and vocabulary sizes must divide by it. Keep a
    group within a node (ranks next to each other): it communicates in every layer."""

    @model_validator(mode="after")
    def _sizes(self) -> "ParallelConfig":
        sizes = {d: getattr(self, d) for d in DIMENSIONS}
        zero = [d for d, s in sizes.items() if s == 0]
        if zero:
            raise ValueError(f"train.parallel.{zero[0]}=0: a dimension has 1 rank or more")
        rest = [d for d, s in sizes.items() if s == -1]
        if len(rest) > 1:
            raise ValueError(
                f"train.parallel.{rest[0]} and {rest[1]} are both -1 (the rest of the world): "
                "set all but one of them"
            )
        micro = self.pp_microbatches
        if micro is not None and self.pp == 1:
            raise ValueError(
                f"train.parallel.pp_microbatches={micro} splits a pipeline's batches, but "
                "train.parallel.pp=1 (no stages): set train.parallel.pp, or unset it"
            )
        if micro is not None and self.pp > 1 and micro < self.pp:
            raise ValueError(
                f"train.parallel.pp_microbatches={micro} is fewer than the pp={self.pp} stages "
                "(the 1F1B schedule needs one in flight per stage): set it to pp or more"
            )
        return self

    @property
    def known_microbatches(self) -> int | None:
        """The pipeline's micro-batches per batch where the config alone tells them
        (pp_microbatches, or pp above 1); None without stages or with pp=-1 unset."""
        return self.pp_microbatches or (self.pp if self.pp > 1 else None)

    def check_with(self, strategy: str, batch_size: int) -> None:
        """ValueError (one line, TrainConfig's validation) for a mesh under ddp, or a
        train.batch_size the pipeline's micro-batches do not divide."""
        if strategy == "ddp" and self != ParallelConfig():
            raise ValueError(
                "train.parallel lays out a train.strategy=fsdp job (its data-parallel "
                "dimensions are FSDP2's): set train.strategy=fsdp, or unset train.parallel"
            )
        micro = self.known_microbatches
        if micro and batch_size % micro:
            raise ValueError(
                f"train.batch_size={batch_size} does not split into train.parallel.pp="
                f"{self.pp}'s {micro} micro-batches: set train.batch_size to a multiple of "
                f"{micro} or train.parallel.pp_microbatches to a divisor of it"
            )

    @property
    def splits_layers(self) -> bool:
        """Whether the model's layers are split (tp above 1): a tensor-parallel plan is needed."""
        return self.tp != 1


@dataclass(frozen=True)
class MeshShape:
    """train.parallel resolved for a world: every size known."""

    pp: int = 1
    dp_replicate: int = 1
    dp_shard: int = 1
    tp: int = 1

    @property
    def dp(self) -> int:
        """Data-parallel ranks: replicas x shards (each takes its own batches)."""
        return self.dp_replicate * self.dp_shard

    @property
    def world(self) -> int:
        """Ranks of the mesh."""
        return self.pp * self.dp * self.tp

    def __str__(self) -> str:
        return " x ".join(f"{d}={getattr(self, d)}" for d in DIMENSIONS)


def mesh_shape(cfg: ParallelConfig, world: int) -> MeshShape:
    """cfg's sizes for a job of `world` ranks; ConfigError (one line, the sizes that would)
    when they do not multiply to `world`."""
    sizes = {d: getattr(cfg, d) for d in DIMENSIONS}
    known = math.prod(s for s in sizes.values() if s != -1)
    rest = [d for d, s in sizes.items() if s == -1]
    if rest and world % known == 0:
        sizes[rest[0]] = world // known
    if math.prod(sizes.values()) != world:
        given = " x ".join(f"{d}={s}" for d, s in sizes.items())
        raise ConfigError(
            f"train.parallel ({given}) does not make up the job's {world} ranks: set the sizes "
            f"to multiply to {world}, or one of them to -1 (the rest of the world)"
        )
    return MeshShape(**sizes)


def microbatches(cfg: ParallelConfig, shape: MeshShape) -> int:
    """The pipeline schedule's micro-batches per batch: train.parallel.pp_microbatches, or
    else one per stage."""
    return cfg.pp_microbatches or shape.pp


def job_shape(strategy: str, cfg: ParallelConfig, world: int) -> MeshShape:
    """The mesh of a train.strategy job of `world` ranks: train.parallel's under fsdp, every
    rank a replica under ddp. ConfigError as mesh_shape."""
    return mesh_shape(cfg, world) if strategy == "fsdp" else MeshShape(dp_replicate=world)
