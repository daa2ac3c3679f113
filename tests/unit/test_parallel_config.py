"""train.parallel's refusals, each one line before anything is queued: sizes that do not make
up the job's ranks, a mesh under ddp, a model with no tensor-parallel plan, and sizes of the
model that tp does not divide (checked on the meta-device model preflight builds)."""

import pytest
from pydantic import ValidationError
from torch import nn

from trainflow.errors import ConfigError
from trainflow.flows.config import build_config
from trainflow.flows.preflight import check_global_batch, check_split
from trainflow.tasks.spec import DataSpec
from trainflow.tasks.train.model_plugins import checked_model
from trainflow.tasks.train.parallel.layout import MeshShape, ParallelConfig, mesh_shape

TOKENS = DataSpec((16,), "int64", "sequence", 40, (16,))


def test_the_sizes_resolve_against_the_world_with_one_rest() -> None:
    assert mesh_shape(ParallelConfig(), 4) == MeshShape(dp_shard=4)
    assert mesh_shape(ParallelConfig(tp=2), 4) == MeshShape(dp_shard=2, tp=2)
    assert mesh_shape(ParallelConfig(dp_replicate=2, dp_shard=2), 4).dp == 4
    assert mesh_shape(ParallelConfig(dp_shard=1, tp=-1), 4) == MeshShape(tp=4)
    with pytest.raises(ConfigError) as refused:
        mesh_shape(ParallelConfig(tp=3), 4)
    assert str(refused.value) == (
        "train.parallel (pp=1 x dp_replicate=1 x dp_shard=-1 x tp=3) does not make up the job's 4 "
        "ranks: set the sizes to multiply to 4, or one of them to -1 (the rest of the world)"
    )
    with pytest.raises(ConfigError, match=r"dp_shard=2 x tp=1\) does not make up the job's 4"):
        mesh_shape(ParallelConfig(dp_shard=2), 4)


@pytest.mark.parametrize(
    "overrides,message",
    [
        (
            ["train.parallel.tp=2"],
            "train.parallel lays out a train.strategy=fsdp job (its data-parallel dimensions "
            "are FSDP2's): set train.strategy=fsdp, or unset train.parallel",
        ),
        (
            ["train.strategy=fsdp", "train.parallel.tp=-1", "train.parallel.dp_shard=-1"],
            "train.parallel.dp_shard and tp are both -1 (the rest of the world): set all but "
            "one of them",
        ),
    ],
)
def test_the_config_refuses_in_one_line(overrides: list[str], message: str) -> None:
    with pytest.raises((ValidationError, ConfigError)) as refused:
        build_config("tiny", overrides)
    assert message in str(refused.value)
    assert len([line for line in str(refused.value).splitlines() if message in line]) == 1


def test_the_preflight_refuses_a_mesh_the_cluster_cannot_make_up() -> None:
    cfg = build_config("tiny", ["train.strategy=fsdp", "train.parallel.tp=4"])  # 2 ranks
    with pytest.raises(ConfigError, match="tp=4\\) does not make up the job's 2 ranks"):
        check_global_batch(cfg.train, cfg)


def _split(model: str, tp: int, **args: object) -> None:
    overrides = [
        f"train.model={model}",
        "train.objective=sequence",
        "train.strategy=fsdp",
        f"train.parallel.tp={tp}",
        f"cluster.ranks_per_node={tp}",
    ]
    cfg = build_config("tiny", overrides)
    cfg = cfg.model_copy(update={"train": cfg.train.model_copy(update={"model_args": args})})
    meta = checked_model(cfg.train, TOKENS)[1]
    check_split(cfg.train, cfg, meta)


def test_the_built_in_transformer_splits_where_its_sizes_divide() -> None:
    _split("transformer", 2)
    _split("transformer", 4, heads=4)


@pytest.mark.parametrize(
    "tp,args,message",
    [
        (
            3,
            {"dim": 48, "heads": 4},
            "train.parallel.tp=3 does not divide the transformer's 4 heads: set "
            "train.parallel.tp to a divisor of 4, or train.model_args.heads",
        ),
        (
            2,
            {"dim": 64, "heads": 2, "hidden": 99},
            "train.parallel.tp=2 does not divide the transformer's 99 hidden: set "
            "train.parallel.tp to a divisor of 99, or train.model_args.hidden",
        ),
        (
            16,
            {"dim": 64, "heads": 16, "hidden": 256},
            "train.parallel.tp=16 does not divide the transformer's 40 vocabulary: set "
            "train.parallel.tp to a divisor of 40",
        ),
    ],
)
def test_sizes_tp_does_not_divide_are_refused_in_one_line(
    tp: int, args: dict[str, object], message: str
) -> None:
    with pytest.raises(ConfigError) as refused:
        _split("transformer", tp, **args)
    assert str(refused.value) == message


def test_a_model_without_a_plan_is_refused_in_one_line() -> None:
    with pytest.raises(ConfigError) as refused:
        _split("token_conv", 2)
    assert str(refused.value) == (
        "train.parallel.tp=2: the model TokenConv has no tensor-parallel plan: give it a "
        "method tp_plan(self, tp) returning its layers' parallel styles (docs/training.md, "
        "Parallelism), use train.model=transformer or a Hugging Face architecture with a plan "
        "(train.model=hf, e.g. llama), or set train.parallel.tp=1"
    )


class Stray(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 4)

    def tp_plan(self, tp: int) -> dict[str, object]:
        return {"projection": object()}


def test_a_plan_naming_no_submodule_is_refused() -> None:
    from trainflow.tasks.train.parallel.tensor_parallel import tp_plan

    with pytest.raises(ConfigError) as refused:
        tp_plan(Stray(), 2)
    assert str(refused.value) == (
        "Stray.tp_plan(2) names ['projection'], which match no submodule of the model: name "
        "its submodules as model.named_modules() does"
    )
