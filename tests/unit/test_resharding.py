"""A sharded checkpoint loads on fewer ranks with every value it saved: real gloo ranks
(tests.unit.reshard_ranks) train the charlm transformer under FSDP with AdamW on 4 ranks and
save; 2 ranks load it (then train and save theirs); 1 rank loads that. Each load is compared
with what was saved, whole (gathered), value by value. A user's optimizer plug-in (Lion,
tests.unit.lion_optimizer) reshards from 2 ranks to 1 the same way."""

from pathlib import Path
from typing import Any

import pytest
import torch

from tests.unit import reshard_ranks

pytestmark = [pytest.mark.services, pytest.mark.timeout(240)]


def _assert_equal(saved: Any, loaded: Any, where: str = "") -> None:
    if isinstance(saved, dict):
        assert saved.keys() == loaded.keys(), where
        for key in saved:
            _assert_equal(saved[key], loaded[key], f"{where}.{key}")
    elif isinstance(saved, list | tuple):
        assert len(saved) == len(loaded), where
        for index, (a, b) in enumerate(zip(saved, loaded, strict=True)):
            _assert_equal(a, b, f"{where}[{index}]")
    elif isinstance(saved, torch.Tensor):
        assert saved.dtype == loaded.dtype and torch.equal(saved, loaded), where
    else:
        assert saved == loaded, where


def test_4_ranks_to_2_to_1_load_the_model_and_optimizer_state_value_by_value(
    tmp_path: Path,
) -> None:
    four = reshard_ranks.run_ranks(4, None, tmp_path / "by4", tmp_path / "4.pt")
    two = reshard_ranks.run_ranks(
        4 // 2, tmp_path / "by4" / "epoch-000001", tmp_path / "by2", tmp_path / "2.pt"
    )
    one = reshard_ranks.run_ranks(1, tmp_path / "by2" / "epoch-000001", None, tmp_path / "1.pt")

    saved = four["saved"]
    assert saved["optimizer"]["state"], "AdamW's moments were saved"
    _assert_equal(saved, two["loaded"])
    _assert_equal(two["saved"], one["loaded"])
    assert not torch.equal(  # the 2 ranks trained on: the 1-rank load is theirs, not the 4's
        two["saved"]["model"]["blocks.0.mlp.0.weight"], saved["model"]["blocks.0.mlp.0.weight"]
    )
    params, moments = one["local"][0]
    for rank in two["local"]:  # 2 ranks hold half each (padding: a row per tensor at most)
        assert params / 2 <= rank[0] <= params / 2 * 1.05
        assert moments / 2 <= rank[1] <= moments / 2 * 1.05


def test_a_plug_in_optimizers_state_reshards_from_2_ranks_to_1_value_by_value(
    tmp_path: Path,
) -> None:
    lion = "tests.unit.lion_optimizer:Lion"
    two = reshard_ranks.run_ranks(2, None, tmp_path / "by2", tmp_path / "2.pt", lion)
    one = reshard_ranks.run_ranks(
        1, tmp_path / "by2" / "epoch-000001", None, tmp_path / "1.pt", lion
    )
    saved = two["saved"]["optimizer"]
    assert saved["state"] and all(set(s) == {"exp_avg"} for s in saved["state"].values())
    _assert_equal(two["saved"], one["loaded"])
