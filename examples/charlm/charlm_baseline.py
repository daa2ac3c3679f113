"""Simple baselines for the character language-model example, on the test split trainflow makes
of the same text.

Run from this folder: `../../.venv/bin/python charlm_baseline.py`. It reads every part through
`stdlib_text.StdlibText` with the example command's arguments (as the preprocessing stage's
workers do, in part order), splits the windows with trainflow's own split (`split_indices`,
with the demo preset's seed and fractions), and prints the test perplexity (exp of the mean
negative log-likelihood per predicted byte, as trainflow's sequence objective reports it) of:

- unigram byte frequencies counted on the train split's targets (add-one smoothed over the
  256 byte values, so a byte unseen in training still has a probability);
- the uniform distribution over the 256 byte values (perplexity 256 by definition).

`--dataset DIR` reads the splits from a dataset a run wrote instead
(`<workdir>/datasets/<hash>`, the manifest's folder), to check that both agree.
"""

import argparse
import json
import sys
from pathlib import Path

import numpy as np

SOURCE_ARGS = {"max_files": 40}
"""The example command's `preprocess.source_args` (the README's command)."""
OVERRIDES = [
    "preprocess.source=stdlib_text:StdlibText",
    f"preprocess.source_args={json.dumps(SOURCE_ARGS)}",
]


def splits_from_source() -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """(windows, next bytes) of each split, split as the preprocessing stage splits them."""
    from stdlib_text import StdlibText

    from trainflow.flows.config import build_config
    from trainflow.tasks.preprocess.run import split_indices

    source = StdlibText(**SOURCE_ARGS)
    parts = [source.read(part) for part in source.parts()]
    x = np.concatenate([p[0] for p in parts])
    y = np.concatenate([p[1] for p in parts])
    members = split_indices(y, build_config("demo", OVERRIDES).preprocess)
    return {name: (x[idx], y[idx]) for name, idx in members.items()}


def splits_from_dataset(folder: Path) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """(windows, next bytes) of each split as a run wrote them."""
    from trainflow.tasks.preprocess.dataset import load_raw_split

    return {name: load_raw_split(folder, name) for name in ("train", "val", "test")}


def baselines(splits: dict[str, tuple[np.ndarray, np.ndarray]]) -> dict[str, float]:
    """Test perplexity of the train split's byte frequencies and of the uniform distribution."""
    counts = np.bincount(splits["train"][1].ravel(), minlength=256).astype(np.float64) + 1.0
    log_p = np.log(counts / counts.sum())
    test = splits["test"][1].ravel()
    return {
        "unigram byte frequencies": float(np.exp(-log_p[test].mean())),
        "uniform over 256 bytes": float(np.exp(np.log(256.0))),
    }


def main(argv: list[str]) -> None:
    """Print each baseline's test perplexity and the split sizes."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dataset", type=Path, help="a dataset folder a run wrote")
    args = parser.parse_args(argv)
    sys.path.insert(0, str(Path(__file__).resolve().parent))  # the example's own modules
    splits = splits_from_dataset(args.dataset) if args.dataset else splits_from_source()
    sizes = ", ".join(f"{name} {len(y)}" for name, (_, y) in splits.items())
    print(
        f"charlm baselines, test perplexity ({sizes} windows of {splits['test'][1].shape[1]} bytes)"
    )
    for name, value in baselines(splits).items():
        print(f"  {name:<26} {value:.1f}")


if __name__ == "__main__":
    main(sys.argv[1:])
