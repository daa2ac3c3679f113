"""train.strategy=fsdp is correct: real gloo ranks (tests.unit.fsdp_ranks) train the charlm
transformer under FSDP2 and DDP on the same global batch as one process does.

Tolerances, and why:
- fp32: the ranks' reductions add the same numbers in another order than one process's
  batch mean (rounding, ~1e-7 relative): losses within 1e-6 relative, weights after 4 SGD
  steps within 1e-6, the first step's gradient norm within 1e-5 relative.
- bf16 policy (FSDP: bf16 parameters for compute, fp32 reduction; one process and DDP: bf16
  autocast of fp32 weights): bf16 keeps 8 bits of mantissa (relative rounding 4e-3 per value)
  and FSDP also rounds the weights themselves, so losses within 1e-3 relative, weights within
  5e-3, gradient norms within 1e-2 relative.
A reduction that summed instead of averaging would give N times the gradient norm (2 or 4):
far outside both.
"""

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from tests.unit import fsdp_ranks
from trainflow.errors import ConfigError
from trainflow.tasks.train.config import TrainConfig
from trainflow.tasks.train.sharding import checkpoint_activations, default_units, sharding_units

TOLERANCE = {
    "fp32": {"loss": 1e-6, "weights": 1e-6, "norm": 1e-5},
    "bf16": {"loss": 1e-3, "weights": 5e-3, "norm": 1e-2},
}


@pytest.fixture(scope="module")
def one_process() -> dict[str, dict[str, Any]]:
    return {p: fsdp_ranks.single_process(p) for p in ("fp32", "bf16")}


def _assert_matches(run: dict[str, Any], ref: dict[str, Any], precision: str) -> None:
    tol = TOLERANCE[precision]
    assert run["losses"] == pytest.approx(ref["losses"], rel=tol["loss"])
    assert run["grad_norm"] / ref["grad_norm"] == pytest.approx(1.0, abs=tol["norm"])
    assert run["weights"].keys() == ref["weights"].keys()
    for name, value in ref["weights"].items():
        torch.testing.assert_close(
            run["weights"][name].float(), value.float(), atol=tol["weights"], rtol=0
        )


def _assert_sharded(local: list[dict[str, int]], world: int, sharded: bool) -> None:
    """Every rank holds ~1/world (padding: at most one row per parameter) of the
    parameters, their gradients and the optimizer's state under FSDP; all of them under DDP.
    Under FSDP only rank 0 built the whole model (the others on the meta device)."""
    assert [bool(r["built_on_meta"]) for r in local] == [sharded and i > 0 for i in range(world)]
    for rank in local:
        full = rank["full_params"]
        for key in ("params", "grads", "optimizer"):
            if sharded:
                assert full / world <= rank[key] <= full / world * 1.05, (key, rank)
            else:
                assert rank[key] == full, (key, rank)


@pytest.mark.services
def test_fsdp_on_2_ranks_matches_ddp_and_one_process_in_fp32_and_bf16(
    one_process: dict[str, dict[str, Any]], tmp_path: Path
) -> None:
    runs = [(s, p) for p in ("fp32", "bf16") for s in ("ddp", "fsdp")]
    results = fsdp_ranks.run_ranks(2, runs, tmp_path / "results.pt")
    for strategy, precision in runs:
        run = results[f"{strategy}-{precision}"]
        _assert_matches(run, one_process[precision], precision)
        _assert_sharded(run["local"], 2, sharded=strategy == "fsdp")
        built = fsdp_ranks.tiny_model().state_dict()  # best.pt, loaded into the trained model
        assert run["reloaded"].keys() == built.keys()
        for key, value in built.items():
            assert torch.equal(run["reloaded"][key], value), (strategy, precision, key)
            assert not torch.equal(run["weights"][key], value) or key.endswith("mask"), key
    fsdp, ddp = results["fsdp-fp32"], results["ddp-fp32"]
    assert fsdp["losses"] == pytest.approx(ddp["losses"], rel=1e-6)
    # every rank continues from the RNG state a DDP rank has after building the model (the
    # meta build draws nothing: rank 0's state is broadcast)
    draws = {r["draw_after_build"] for run in (fsdp, ddp) for r in run["local"]}
    assert len(draws) == 1, draws


@pytest.mark.services
def test_fsdp_on_4_ranks_averages_gradients_and_holds_a_quarter_per_rank(
    one_process: dict[str, dict[str, Any]], tmp_path: Path
) -> None:
    results = fsdp_ranks.run_ranks(4, [("fsdp", "fp32")], tmp_path / "results.pt")
    run = results["fsdp-fp32"]
    _assert_matches(run, one_process["fp32"], "fp32")  # a sum: a gradient norm 4x as large
    _assert_sharded(run["local"], 4, sharded=True)


def test_blocks_a_model_names_are_its_sharding_units() -> None:
    model = fsdp_ranks.tiny_model()
    assert sharding_units(model) == list(model.blocks)  # type: ignore[arg-type]


def test_the_default_units_are_the_children_with_parameters_less_tied_ones() -> None:
    model = fsdp_ranks.tiny_model()
    units = default_units(model)
    # tokens and head share their weight: both stay with the root; positions, the norm and
    # the blocks (the items of the ModuleList) are units; the mask buffer is no parameter.
    assert units == [model.positions, *model.blocks, model.norm]  # type: ignore[misc]
    plain = nn.Sequential(nn.Linear(2, 3), nn.ReLU(), nn.Linear(3, 1))
    assert default_units(nn.ModuleDict({"body": plain})) == [plain[0], plain[2]]


def test_units_that_are_not_the_models_own_are_refused() -> None:
    class Stray(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layer = nn.Linear(2, 2)

        def shard_units(self) -> list[nn.Module]:
            return [nn.Linear(2, 2)]

    with pytest.raises(ConfigError, match="not submodules of the model"):
        sharding_units(Stray())


def test_activation_checkpointing_recomputes_blocks_with_the_same_gradients() -> None:
    x, y = fsdp_ranks.global_batches()[0]
    grads, calls = [], []
    for checkpointed in (False, True):
        model = fsdp_ranks.tiny_model()
        if checkpointed:
            checkpoint_activations(sharding_units(model))
        ran: list[int] = []
        blocks: Any = model.blocks
        mlp = blocks[0].mlp
        mlp.register_forward_pre_hook(lambda *_, ran=ran: ran.append(1))
        logits = model(x)
        torch.nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten()).backward()
        grads.append([p.grad for p in model.parameters()])
        calls.append(len(ran))
        assert set(model.state_dict()) == set(fsdp_ranks.tiny_model().state_dict())
    assert calls == [1, 2]  # the block's MLP ran again in the backward pass
    for plain, recomputed in zip(*grads, strict=True):
        torch.testing.assert_close(plain, recomputed)


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"compile": True}, "does not support train.compile or train.cuda_graphs"),
        ({"cuda_graphs": True, "device": "auto"}, "does not support train.compile"),
        ({"precision": "fp16"}, "does not support precision=fp16"),
        ({"channels_last": "on"}, "cannot shard channels_last conv weights"),
    ],
)
def test_fsdp_combinations_it_cannot_run_are_refused_in_one_line(
    settings: dict[str, Any], message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        TrainConfig(strategy="fsdp", **settings)
