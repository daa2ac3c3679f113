"""Pipeline stages without ranks: train.parallel.pp's refusals (one line each, before any
job), each rank's data-parallel place with stages on the mesh, and the built-in transformer's
cut: its stages, run one after another, compute the whole model, and hold its parameters
under the whole model's names, each in exactly one stage; the layout of a checkpoint's
optimizer state that keeps every stage's groups."""

from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from pydantic import ValidationError
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

from trainflow.errors import ConfigError
from trainflow.flows.config import build_config
from trainflow.flows.preflight import check_split
from trainflow.tasks.spec import DataSpec
from trainflow.tasks.train.checkpointing.sharded_checkpoint import flat_optimizer, load_sharded
from trainflow.tasks.train.config import TrainConfig
from trainflow.tasks.train.distributed import DistContext
from trainflow.tasks.train.model_plugins import checked_model
from trainflow.tasks.train.parallel.layout import ParallelConfig, mesh_shape, microbatches
from trainflow.tasks.train.parallel.pipeline import check_stages, stage_module
from trainflow.tasks.train.transformer import transformer

SPEC = DataSpec((16,), "int64", "sequence", 30, (16,))


def refusal(**keys: object) -> str:
    with pytest.raises(ValidationError) as caught:
        TrainConfig(strategy="fsdp", **keys)
    (error,) = caught.value.errors()
    return str(error["msg"])


def test_pp_refusals_name_the_key_and_the_fix_in_one_line() -> None:
    few = refusal(parallel={"pp": 4, "pp_microbatches": 2})
    assert "pp_microbatches=2" in few and "set it to pp or more" in few
    uneven = refusal(batch_size=10, parallel={"pp": 4})
    assert "train.batch_size=10" in uneven and "multiple of 4" in uneven
    uneven = refusal(batch_size=16, parallel={"pp": 2, "pp_microbatches": 3})
    assert "multiple of 3" in uneven
    idle = refusal(parallel={"pp_microbatches": 4})
    assert "train.parallel.pp=1 (no stages)" in idle
    for message in (few, uneven, idle):
        assert "\n" not in message


def test_pp_is_the_outermost_dimension_and_microbatches_default_to_the_stages() -> None:
    cfg = ParallelConfig(pp=2)
    shape = mesh_shape(cfg, 8)
    assert (shape.pp, shape.dp_replicate, shape.dp_shard, shape.tp) == (2, 1, 4, 1)
    assert str(shape) == "pp=2 x dp_replicate=1 x dp_shard=4 x tp=1"
    assert microbatches(cfg, shape) == 2
    assert microbatches(ParallelConfig(pp=2, pp_microbatches=8), shape) == 8
    assert mesh_shape(ParallelConfig(pp=-1, dp_shard=2), 8).pp == 4
    with pytest.raises(ConfigError, match="does not make up the job's 6 ranks"):
        mesh_shape(ParallelConfig(pp=4, dp_shard=1), 6)


def test_the_stages_of_a_pipeline_take_the_same_batches() -> None:
    # pp=2 x dp_shard=2 x tp=2 on 8 ranks: rank = (stage * 2 + dp) * 2 + t
    cpu = torch.device("cpu")
    places = [
        (ctx.dp_rank, ctx.dp_size)
        for ctx in (DistContext(r, 8, r, cpu, "gloo", tp=2, pp=2) for r in range(8))
    ]
    assert places == [(0, 2), (0, 2), (1, 2), (1, 2), (0, 2), (0, 2), (1, 2), (1, 2)]
    alone = [DistContext(r, 4, r, cpu, "gloo", pp=2).dp_rank for r in range(4)]
    assert alone == [0, 1, 0, 1]


def test_the_transformers_stages_compute_the_whole_model_under_its_names() -> None:
    torch.manual_seed(0)
    whole = transformer(SPEC, dim=32, layers=4, heads=4)
    ids = torch.randint(0, 30, (3, 16))
    stages = [stage_module(whole, s, 2) for s in range(2)]
    out = stages[1](stages[0](ids))
    torch.testing.assert_close(out, whole(ids), rtol=0, atol=0)
    names = [set(stage.state_dict()) for stage in stages]
    assert not names[0] & names[1] and names[0] | names[1] == set(whole.state_dict())
    assert "layers.3.attention.wq.weight" in names[1] and "tok_embeddings.weight" in names[0]


def test_a_model_without_a_cut_and_layers_that_do_not_divide_are_refused() -> None:
    with pytest.raises(ConfigError, match=r"names no pipeline stages: give it a method pp_split"):
        stage_module(nn.Sequential(nn.Linear(2, 2)), 0, 2)
    three = transformer(SPEC, dim=32, layers=3, heads=4)
    with pytest.raises(ConfigError, match="pp=2 does not divide the transformer's 3 layers"):
        stage_module(three, 0, 2)


class Renamed(nn.Module):
    """A model whose cut puts its layer under another name."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(2, 2)

    def pp_split(self, stage: int, stages: int) -> nn.Module:
        return nn.Sequential(self.body)  # "0.weight", not "body.weight"


def test_a_cut_that_renames_the_models_parameters_is_refused() -> None:
    with pytest.raises(ConfigError, match=r"returned tensors \['0.weight', '0.bias'\]"):
        stage_module(Renamed(), 0, 2)


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # DCP in one process
@pytest.mark.parametrize("flat", [True, False], ids=["per-name groups", "one list (older)"])
def test_a_checkpoints_optimizer_loads_in_either_layout(tmp_path: Path, flat: bool) -> None:
    """Checkpoints keep the optimizer's groups per parameter name (each pipeline stage its
    own); those written before, one list of groups, load as well."""
    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(4, 3)).sum().backward()
    optimizer.step()
    options = StateDictOptions(flatten_optimizer_state_dict=flat)
    model_state, optim_state = get_state_dict(model, optimizer, options=options)
    dcp.save({"model": model_state, "optimizer": optim_state}, checkpoint_id=tmp_path)
    assert flat_optimizer(tmp_path) == flat

    fresh = nn.Linear(3, 2)
    fresh_optimizer = torch.optim.SGD(fresh.parameters(), lr=0.5, momentum=0.1)
    load_sharded(fresh, fresh_optimizer, tmp_path)
    torch.testing.assert_close(fresh.state_dict(), model.state_dict(), rtol=0, atol=0)
    assert fresh_optimizer.param_groups[0]["lr"] == 0.1
    assert fresh_optimizer.param_groups[0]["momentum"] == 0.9
    for p, q in zip(model.parameters(), fresh.parameters(), strict=True):
        want = optimizer.state[p]["momentum_buffer"]
        torch.testing.assert_close(fresh_optimizer.state[q]["momentum_buffer"], want)


class Partial(Renamed):
    """A model whose cut leaves its layer out of every stage."""

    def pp_split(self, stage: int, stages: int) -> nn.Module:
        return nn.Module()


def preflight(model: str, pp: int, **args: object) -> None:
    """The preflight's check of train.parallel.pp={pp} on `model`'s meta build (pp ranks)."""
    overrides = [
        f"train.model={model}",
        "train.objective=sequence",
        "train.strategy=fsdp",
        f"train.parallel.pp={pp}",
        "train.batch_size=16",
        f"cluster.ranks_per_node={pp}",
    ]
    cfg = build_config("tiny", overrides)
    cfg = cfg.model_copy(update={"train": cfg.train.model_copy(update={"model_args": args})})
    check_split(cfg.train, cfg, checked_model(cfg.train, SPEC)[1])


def test_the_preflight_refuses_a_cut_before_any_job() -> None:
    preflight("transformer", 2, layers=4)  # 2 blocks a stage: no refusal
    with pytest.raises(ConfigError) as refused:
        preflight("transformer", 2, layers=3)
    assert str(refused.value) == (
        "train.parallel.pp=2 does not divide the transformer's 3 layers: set "
        "train.parallel.pp to a divisor of 3, or train.model_args.layers"
    )
    with pytest.raises(ConfigError, match="TokenConv names no pipeline stages: give it a"):
        preflight("token_conv", 2)
    with pytest.raises(ConfigError, match=r"puts body.weight in 0 of the 2 stages"):
        check_stages(Partial(), 2)
