"""Figures people would rather look at than read: confusion matrix and training curves."""

import matplotlib

matplotlib.use("Agg")  # headless: cluster nodes and CI have no display

import matplotlib.pyplot as plt
import numpy as np
from matplotlib.figure import Figure


def confusion_figure(cm: np.ndarray, classes: list[str]) -> Figure:
    """Row-normalised confusion matrix with counts in the cells."""
    rows = cm.sum(axis=1, keepdims=True)
    norm = np.divide(cm, rows, out=np.zeros(cm.shape), where=rows > 0)
    size = max(4.0, 0.5 * len(classes) + 2)
    fig, ax = plt.subplots(figsize=(size, size))
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


def curves_figure(history: list[dict[str, float]]) -> Figure:
    """Loss and accuracy per epoch, train against validation."""
    epochs = [int(h["epoch"]) for h in history]
    fig, (loss_ax, acc_ax) = plt.subplots(1, 2, figsize=(10, 4))
    for key, ax in (("loss", loss_ax), ("accuracy", acc_ax)):
        for split in ("train", "val"):
            name = f"{split}_{key}"
            if all(name in h for h in history):
                ax.plot(epochs, [h[name] for h in history], marker="o", label=split)
        ax.set_xlabel("epoch")
        ax.set_ylabel(key)
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle("Training curves")
    fig.tight_layout()
    return fig


def close(fig: Figure) -> None:
    """Free a figure's memory (pyplot keeps references otherwise)."""
    plt.close(fig)
