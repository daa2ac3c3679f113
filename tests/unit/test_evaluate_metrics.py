"""Metrics from predictions, checked against hand-computed values."""

import numpy as np
import pytest

from trainflow.tasks.objectives import metrics, plots


def test_confusion_matrix_counts() -> None:
    y = np.array([0, 0, 1, 1, 2, 2])
    p = np.array([0, 1, 1, 1, 2, 0])
    cm = metrics.confusion_matrix(y, p, 3)
    assert cm.tolist() == [[1, 1, 0], [0, 2, 0], [1, 0, 1]]
    assert metrics.accuracy(cm) == pytest.approx(4 / 6)


def test_per_class_precision_recall_f1() -> None:
    cm = np.array([[1, 1, 0], [0, 2, 0], [1, 0, 1]])
    rep = metrics.per_class_report(cm, ["a", "b", "c"])
    assert rep["a"].precision == pytest.approx(0.5)
    assert rep["a"].recall == pytest.approx(0.5)
    assert rep["b"].precision == pytest.approx(2 / 3)
    assert rep["b"].recall == pytest.approx(1.0)
    assert rep["b"].f1 == pytest.approx(0.8)
    assert rep["c"].precision == pytest.approx(1.0)
    assert rep["c"].recall == pytest.approx(0.5)
    assert rep["c"].support == 2


def test_class_never_predicted_has_zero_precision_not_nan() -> None:
    cm = np.array([[2, 0], [1, 0]])
    rep = metrics.per_class_report(cm, ["x", "y"])
    assert rep["y"].precision == 0.0 and rep["y"].f1 == 0.0
    flat = metrics.flat_metrics(cm, rep)
    assert not any(np.isnan(v) for v in flat.values())
    assert flat["test_accuracy"] == pytest.approx(2 / 3)


def test_figures_render() -> None:
    cm = np.array([[5, 1], [0, 4]])
    fig = plots.confusion_figure(cm, ["a", "b"])
    assert fig.axes
    plots.close(fig)
    hist = [
        {
            "epoch": 1,
            "train_loss": 1.0,
            "val_loss": 1.1,
            "train_accuracy": 0.5,
            "val_accuracy": 0.4,
        },
        {
            "epoch": 2,
            "train_loss": 0.5,
            "val_loss": 0.6,
            "train_accuracy": 0.8,
            "val_accuracy": 0.7,
        },
    ]
    fig = plots.curves_figure(hist)
    assert len(fig.axes) == 2 and len(fig.axes[0].lines) == 2
    plots.close(fig)
