"""Figures people would rather look at than read: confusion matrix, training curves,
predicted-vs-true and residuals (regression), token accuracy by position (sequence)."""

from typing import Any

import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure


def _subplots(*grid: int, figsize: tuple[float, float]) -> tuple[Figure, Any]:
    """A figure drawn by Agg (headless: cluster nodes and CI have no display) and its axes,
    without pyplot: no global figure registry to leak into, and ~0.3 CPU s less to import."""
    fig = Figure(figsize=figsize)
    FigureCanvasAgg(fig)
    return fig, fig.subplots(*grid)


def confusion_figure(cm: np.ndarray, classes: list[str]) -> Figure:
    """Row-normalised confusion matrix with counts in the cells."""
    rows = cm.sum(axis=1, keepdims=True)
    norm = np.divide(cm, rows, out=np.zeros(cm.shape), where=rows > 0)
    size = max(4.0, 0.5 * len(classes) + 2)
    fig, ax = _subplots(figsize=(size, size))
    ax.imshow(norm, cmap="Blues", vmin=0, vmax=1)
    ticks = range(len(classes))
    ax.set_xticks(ticks, classes, rotation=90 if len(classes) > 10 else 0)
    ax.set_yticks(ticks, classes)
    ax.set_xlabel("predicted")
    ax.set_ylabel("true")
    ax.set_title(f"Confusion matrix (test, n={int(cm.sum())})")
    if len(classes) <= 20:
        for i in ticks:
            for j in ticks:
                color = "white" if norm[i, j] > 0.5 else "black"
                ax.text(j, i, str(cm[i, j]), ha="center", va="center", color=color, fontsize=8)
    fig.tight_layout()
    return fig


def curves_figure(history: list[dict[str, float]], metric: str = "accuracy") -> Figure:
    """Loss and `metric` (the objective's headline) per validation, train against
    validation: against the epoch, or the global step where validations ran inside epochs
    (train.val_every_steps) or no epoch ended (train.max_steps)."""
    epochs = [int(h["epoch"]) for h in history]
    axis = "epoch" if len(set(epochs)) == len(epochs) and 0 not in epochs else "step"
    xs = [int(h[axis]) for h in history]
    fig, (loss_ax, acc_ax) = _subplots(1, 2, figsize=(10, 4))
    for key, ax in (("loss", loss_ax), (metric, acc_ax)):
        for split in ("train", "val"):
            name = f"{split}_{key}"
            if all(name in h for h in history):
                ax.plot(xs, [h[name] for h in history], marker="o", label=split)
        ax.set_xlabel(axis)
        ax.set_ylabel(key)
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle("Training curves")
    fig.tight_layout()
    return fig


def close(fig: Figure) -> None:
    """Free a figure's artists now (nothing else holds the figure: no pyplot)."""
    fig.clear()


def predicted_vs_true_figure(pred: np.ndarray, true: np.ndarray) -> Figure:
    """Scatter of predictions against targets, with the identity line."""
    fig, ax = _subplots(figsize=(5, 5))
    ax.scatter(true, pred, s=4, alpha=0.4)
    if len(true):
        low, high = float(min(true.min(), pred.min())), float(max(true.max(), pred.max()))
        ax.plot([low, high], [low, high], color="black", linewidth=1)
    ax.set_xlabel("true")
    ax.set_ylabel("predicted")
    ax.set_title(f"Predicted vs true (test, {len(true)} values)")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    return fig


def residual_figure(residuals: np.ndarray) -> Figure:
    """Histogram of prediction minus target."""
    fig, ax = _subplots(figsize=(6, 4))
    low, high = (float(residuals.min()), float(residuals.max())) if len(residuals) else (0, 0)
    if high - low < 1e-6 * (1.0 + abs(high)):  # (near) constant: 50 bins would not fit
        low, high = low - 0.5, high + 0.5
    ax.hist(residuals, bins=50, range=(low, high))
    ax.set_xlabel("predicted - true")
    ax.set_ylabel("count")
    ax.set_title(f"Residuals (test, {len(residuals)} values)")
    fig.tight_layout()
    return fig


def per_position_figure(accuracy: list[float]) -> Figure:
    """Token accuracy at each position of the sequence."""
    fig, ax = _subplots(figsize=(6, 4))
    ax.plot(range(len(accuracy)), accuracy, marker=".")
    ax.set_xlabel("position")
    ax.set_ylabel("token accuracy")
    ax.set_title("Token accuracy by position (test)")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    return fig
