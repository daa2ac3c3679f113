"""Objectives: their metrics against reference formulas, their checks of the data, their
direction, and the registry that builds ours and a user's the same way."""

import itertools
import math
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from trainflow.errors import DataError
from trainflow.flows.config import build_config
from trainflow.flows.preflight import preflight
from trainflow.tasks.objectives import Objective, check_data, is_better, make_objective
from trainflow.tasks.plugins import PluginError
from trainflow.tasks.spec import DataSpec
from trainflow.tasks.train.ref import CheckpointRef
from trainflow.tasks.train.sweep import best_element

REGRESSION = DataSpec((5,), "float32", "regression", None, (3,), "float32")
SEQUENCE = DataSpec((6,), "int64", "sequence", 7, (6,), "int64")
CLASSES = DataSpec((1, 12, 12), "float32", "classification", 4, (), "int64")


def _summed(objective: Objective, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> list[float]:
    total = torch.zeros(objective.sums_size, dtype=torch.float64)
    for output, target in batches:
        total += objective.sums(output, target)
    return [float(v) for v in total]


def _batches(
    out: np.ndarray, target: np.ndarray, cuts: list[int]
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Uneven batches: metrics of summed batches must not depend on where they are cut."""
    bounds = [0, *cuts, len(out)]
    return [
        (torch.from_numpy(out[a:b]), torch.from_numpy(target[a:b]))
        for a, b in itertools.pairwise(bounds)
    ]


def test_regression_metrics_match_their_formulas_per_output() -> None:
    rng = np.random.default_rng(0)
    y = rng.normal(size=(50, 3)).astype(np.float32) * np.array([1.0, 10.0, 0.1], np.float32)
    pred = (y + rng.normal(size=y.shape).astype(np.float32) * 0.5).astype(np.float32)
    objective = make_objective("regression", REGRESSION)
    got = objective.metrics(_summed(objective, _batches(pred, y, [7, 30])))
    err = pred.astype(np.float64) - y
    for i in range(3):
        ss_res = (err[:, i] ** 2).sum()
        ss_tot = ((y[:, i] - y[:, i].mean()) ** 2).sum()
        assert got[f"mae_{i}"] == pytest.approx(np.abs(err[:, i]).mean(), rel=1e-9)
        assert got[f"rmse_{i}"] == pytest.approx(math.sqrt((err[:, i] ** 2).mean()), rel=1e-9)
        assert got[f"r2_{i}"] == pytest.approx(1 - ss_res / ss_tot, rel=1e-6)
    assert got["rmse"] == pytest.approx(math.sqrt((err**2).mean()), rel=1e-9)
    assert got["r2"] == pytest.approx(np.mean([got[f"r2_{i}"] for i in range(3)]))
    assert got["loss"] == pytest.approx((err**2).mean(), rel=1e-6)  # MSE
    l1 = make_objective("regression", REGRESSION, {"loss": "l1"})
    assert l1.metrics(_summed(l1, _batches(pred, y, [20])))["loss"] == pytest.approx(
        np.abs(err).mean(), rel=1e-6
    )
    assert float(l1.loss(torch.from_numpy(pred), torch.from_numpy(y))) == pytest.approx(
        np.abs(err).mean(), rel=1e-5
    )


def test_sequence_metrics_are_per_token_cross_entropy_accuracy_and_perplexity() -> None:
    rng = np.random.default_rng(1)
    logits = rng.normal(size=(9, 6, 7)).astype(np.float32)
    ids = rng.integers(0, 7, size=(9, 6))
    objective = make_objective("sequence", SEQUENCE)
    got = objective.metrics(_summed(objective, _batches(logits, ids, [4])))
    flat = logits.reshape(-1, 7).astype(np.float64)
    log_softmax = flat - np.log(np.exp(flat).sum(axis=1, keepdims=True))
    nll = -log_softmax[np.arange(len(flat)), ids.reshape(-1)].mean()
    assert got["loss"] == pytest.approx(nll, rel=1e-6)
    assert got["perplexity"] == pytest.approx(math.exp(nll), rel=1e-6)
    assert got["token_accuracy"] == pytest.approx((flat.argmax(1) == ids.reshape(-1)).mean())


def test_classification_metrics_and_report() -> None:
    rng = np.random.default_rng(2)
    logits = rng.normal(size=(40, 4)).astype(np.float32)
    labels = rng.integers(0, 4, size=40)
    objective = make_objective("classification", CLASSES)
    got = objective.metrics(_summed(objective, _batches(logits, labels, [13])))
    assert got["accuracy"] == pytest.approx((logits.argmax(1) == labels).mean())
    report = objective.report(_batches(logits, labels, [13]), ["a", "b", "c", "d"])
    assert report.metrics["test_accuracy"] == pytest.approx(got["accuracy"])
    assert set(report.figures) == {"confusion_matrix.png"}


def test_reports_hold_the_objectives_artifacts() -> None:
    rng = np.random.default_rng(3)
    y = rng.normal(size=(30, 3)).astype(np.float32)
    regression = make_objective("regression", REGRESSION).report(_batches(y + 0.1, y, [10]), [])
    assert set(regression.figures) == {"predicted_vs_true.png", "residuals.png"}
    assert regression.metrics["test_mae"] == pytest.approx(0.1, rel=1e-4)
    ids = rng.integers(0, 7, size=(5, 6))
    logits = np.eye(7, dtype=np.float32)[ids] * 5  # always right
    sequence = make_objective("sequence", SEQUENCE).report(_batches(logits, ids, [2]), [])
    assert sequence.metrics["test_token_accuracy"] == 1.0
    assert sequence.documents["token_accuracy_by_position.json"] == [1.0] * 6


@pytest.mark.parametrize(
    ("objective", "spec", "fix"),
    [
        ("regression", CLASSES, "set train.objective=classification"),
        ("sequence", CLASSES, "targets with a time axis"),
        ("classification", REGRESSION, "set train.objective=regression"),
        ("classification", SEQUENCE, "set train.objective=sequence"),
        ("sequence", REGRESSION, "set train.objective=regression"),
    ],
)
def test_an_objective_that_does_not_fit_the_data_says_so_in_one_line(
    objective: str, spec: DataSpec, fix: str
) -> None:
    with pytest.raises(DataError, match=fix) as err:
        check_data(objective, {}, spec)
    assert "\n" not in str(err.value)


def test_directions_pick_the_better_value() -> None:
    regression = make_objective("regression", REGRESSION)
    sequence = make_objective("sequence", SEQUENCE)
    assert is_better(regression, "val_loss", 0.1, 0.2) and is_better(
        regression, "test_r2", 0.9, 0.8
    )
    assert not is_better(regression, "test_rmse", 0.3, 0.2)
    assert is_better(sequence, "test_perplexity", 3.0, 4.0)
    assert is_better(make_objective("classification", CLASSES), "val_accuracy", 0.9, 0.8)


def test_a_users_objective_resolves_like_ours_and_its_errors_name_it(tmp_path: Path) -> None:
    (tmp_path / "my_objective.py").write_text(
        "from trainflow.tasks.objectives.regression import Regression\n"
        "class Huber(Regression):\n"
        "    def __init__(self, spec, delta=1.0):\n"
        "        super().__init__(spec)\n"
        "        self.delta = delta\n"
        "def broken(spec):\n"
        "    raise ValueError('no such thing')\n"
    )
    sys.path.insert(0, str(tmp_path))
    try:
        objective = make_objective("my_objective:Huber", REGRESSION, {"delta": 2.0})
        assert objective.delta == 2.0  # type: ignore[attr-defined]
        with pytest.raises(PluginError, match=r"my_objective\.py:7"):
            make_objective("my_objective:broken", REGRESSION)
        with pytest.raises(PluginError, match=r"train\.objective='nonesuch'"):
            make_objective("nonesuch", REGRESSION)
    finally:
        sys.path.remove(str(tmp_path))
        sys.modules.pop("my_objective", None)


@pytest.mark.parametrize(
    ("objective", "fix"),
    [("regression", "needs float targets"), ("sequence", "targets with a time axis")],
)
def test_preflight_refuses_an_objective_the_data_does_not_fit(
    tmp_path: Path, objective: str, fix: str
) -> None:
    cfg = build_config("tiny", [f"workdir={tmp_path}", f"train.objective={objective}"])
    with pytest.raises(DataError, match=fix):
        preflight(cfg)  # before any server, cluster or job
    preflight(build_config("tiny", [f"workdir={tmp_path}"]))  # classification fits


def test_a_sweep_picks_the_best_element_in_the_objectives_direction(tmp_path: Path) -> None:
    def ref(loss: float) -> CheckpointRef:
        metrics = {"val_loss": loss}
        return CheckpointRef(
            path=tmp_path, sha256="", epoch=1, step=1, metrics=metrics, history_path=tmp_path
        )

    outcomes = [ref(0.5), "failed", ref(0.2), ref(0.9)]
    assert best_element(outcomes, "val_loss", higher_is_better=False) == 2
    assert best_element(outcomes, "val_loss", higher_is_better=True) == 3
