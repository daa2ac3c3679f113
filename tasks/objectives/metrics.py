"""Classification metrics from predictions: accuracy, confusion matrix, per-class P/R/F1."""

import numpy as np
from pydantic import BaseModel, ConfigDict


class ClassReport(BaseModel):
    """Precision, recall, F1 and support of one class."""

    model_config = ConfigDict(frozen=True)

    precision: float
    recall: float
    f1: float
    support: int


def confusion_matrix(y_true: np.ndarray, y_pred: np.ndarray, num_classes: int) -> np.ndarray:
    """Counts [true class, predicted class] as an int64 (K, K) matrix."""
    flat = y_true.astype(np.int64) * num_classes + y_pred.astype(np.int64)
    return np.bincount(flat, minlength=num_classes * num_classes).reshape(num_classes, -1)


def per_class_report(cm: np.ndarray, classes: list[str]) -> dict[str, ClassReport]:
    """Per-class precision/recall/F1 from a confusion matrix (0 where undefined)."""
    tp = np.diag(cm).astype(np.float64)
    predicted = cm.sum(axis=0)
    actual = cm.sum(axis=1)
    precision = np.divide(tp, predicted, out=np.zeros_like(tp), where=predicted > 0)
    recall = np.divide(tp, actual, out=np.zeros_like(tp), where=actual > 0)
    denom = precision + recall
    f1 = np.divide(2 * precision * recall, denom, out=np.zeros_like(tp), where=denom > 0)
    return {
        name: ClassReport(
            precision=float(precision[i]),
            recall=float(recall[i]),
            f1=float(f1[i]),
            support=int(actual[i]),
        )
        for i, name in enumerate(classes)
    }


def accuracy(cm: np.ndarray) -> float:
    """Share of correct predictions."""
    total = cm.sum()
    return float(np.trace(cm) / total) if total else 0.0


def flat_metrics(cm: np.ndarray, report: dict[str, ClassReport]) -> dict[str, float]:
    """Test metrics as flat MLflow metric names: accuracy, macro F1, per-class P/R/F1."""
    out = {
        "test_accuracy": accuracy(cm),
        "test_macro_f1": float(np.mean([r.f1 for r in report.values()])),
    }
    for name, r in report.items():
        out[f"test_precision_{name}"] = r.precision
        out[f"test_recall_{name}"] = r.recall
        out[f"test_f1_{name}"] = r.f1
    return out
