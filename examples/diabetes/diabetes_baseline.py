"""Simple baselines for the diabetes example, on the test split trainflow makes of the same data.

Run from this folder: `../../.venv/bin/python diabetes_baseline.py`. It reads every part through
`diabetes_source.DiabetesCSV` (as the preprocessing stage's workers do, in part order), splits
the rows with trainflow's own split (`split_indices`, with the preprocess config of the
example's command: the demo preset's seed and fractions), and prints the test R² (1 - squared
error / the test targets' variance about their mean, as trainflow's regression objective
computes it) of two predictors fitted on the train split alone:

- the train split's mean target, for every patient;
- linear least squares on the 10 measurements plus an intercept.

`--dataset DIR` reads the splits from a dataset a run wrote instead
(`<workdir>/datasets/<hash>`, the manifest's folder), to check that both agree.
"""

import argparse
import sys
from pathlib import Path

import numpy as np

OVERRIDES = ["preprocess.source=diabetes_source:DiabetesCSV"]
"""The example command's preprocessing settings (the rest are the demo preset's)."""


def splits_from_source() -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """(features, targets) of each split, split as the preprocessing stage splits them."""
    from diabetes_source import DiabetesCSV

    from trainflow.flows.config import build_config
    from trainflow.tasks.preprocess.run import split_indices

    source = DiabetesCSV()
    parts = [source.read(part) for part in source.parts()]
    x = np.concatenate([p[0] for p in parts])
    y = np.concatenate([p[1] for p in parts])
    members = split_indices(y, build_config("demo", OVERRIDES).preprocess)
    return {name: (x[idx], y[idx]) for name, idx in members.items()}


def splits_from_dataset(folder: Path) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """(features, targets) of each split as a run wrote them (before normalisation)."""
    from trainflow.tasks.preprocess.dataset import load_raw_split

    return {name: load_raw_split(folder, name) for name in ("train", "val", "test")}


def r2(pred: np.ndarray, y: np.ndarray) -> float:
    """1 - the squared error over the variance of y about its own mean."""
    y64 = y.astype(np.float64)
    return float(1.0 - ((pred - y64) ** 2).sum() / ((y64 - y64.mean()) ** 2).sum())


def baselines(splits: dict[str, tuple[np.ndarray, np.ndarray]]) -> dict[str, float]:
    """Test R² of the train mean and of a least-squares linear fit to the train split."""
    (x_train, y_train), (x_test, y_test) = splits["train"], splits["test"]
    mean = np.full(len(y_test), float(y_train.astype(np.float64).mean()))

    def design(x: np.ndarray) -> np.ndarray:
        return np.hstack([x.astype(np.float64), np.ones((len(x), 1))])

    weights, *_ = np.linalg.lstsq(design(x_train), y_train.astype(np.float64), rcond=None)
    return {
        "train mean": r2(mean, y_test),
        "linear least squares": r2(design(x_test) @ weights, y_test),
    }


def main(argv: list[str]) -> None:
    """Print each baseline's test R² and the split sizes."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dataset", type=Path, help="a dataset folder a run wrote")
    args = parser.parse_args(argv)
    sys.path.insert(0, str(Path(__file__).resolve().parent))  # the example's own modules
    splits = splits_from_dataset(args.dataset) if args.dataset else splits_from_source()
    sizes = ", ".join(f"{name} {len(y)}" for name, (_, y) in splits.items())
    print(f"diabetes baselines, test R² ({sizes} rows)")
    for name, value in baselines(splits).items():
        print(f"  {name:<22} {value:.3f}")


if __name__ == "__main__":
    main(sys.argv[1:])
