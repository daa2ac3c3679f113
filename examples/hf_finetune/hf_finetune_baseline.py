"""Baselines for the fine-tuning example, on the test split of the dataset a run wrote:

- the base model as prepare.py saved it, before fine-tuning (what fine-tuning must improve);
- unigram token frequencies counted on the train split's targets (add-one smoothed over the
  tokenizer's vocabulary).

Both as test perplexity: exp of the mean negative log-likelihood per predicted token, as
trainflow's sequence objective reports it.

`../../.venv/bin/python hf_finetune_baseline.py --dataset <workdir>/datasets/<hash>`
"""

import argparse
import math
from pathlib import Path

import numpy as np
import torch

HERE = Path(__file__).resolve().parent


def splits_from_dataset(folder: Path) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """(windows, next tokens) of each split as a run wrote them."""
    from trainflow.tasks.preprocess.dataset import load_raw_split

    return {name: load_raw_split(folder, name) for name in ("train", "val", "test")}


def base_model_perplexity(
    x: np.ndarray, y: np.ndarray, folder: Path = HERE / "base-model"
) -> float:
    """Test perplexity of the saved base model (fp32, CPU)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, local_files_only=True).eval()
    total, count = 0.0, 0
    with torch.no_grad():
        for start in range(0, len(x), 64):
            xb = torch.from_numpy(x[start : start + 64]).long()
            yb = torch.from_numpy(y[start : start + 64]).long()
            logits = model(xb).logits
            loss = torch.nn.functional.cross_entropy(
                logits.flatten(0, 1), yb.flatten(), reduction="sum"
            )
            total, count = total + float(loss), count + yb.numel()
    return math.exp(total / count)


def baselines(splits: dict[str, tuple[np.ndarray, np.ndarray]]) -> dict[str, float]:
    """Test perplexity of the base model and of the train split's token frequencies."""
    from transformers import AutoConfig

    vocab = AutoConfig.from_pretrained(HERE / "base-model", local_files_only=True).vocab_size
    counts = np.bincount(splits["train"][1].ravel(), minlength=vocab).astype(np.float64) + 1.0
    log_p = np.log(counts / counts.sum())
    x, y = splits["test"]
    return {
        "base model, before fine-tuning": base_model_perplexity(x, y),
        "unigram token frequencies": float(np.exp(-log_p[y.ravel()].mean())),
    }


def main() -> None:
    """Print each baseline's test perplexity."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dataset", type=Path, required=True, help="a dataset folder a run wrote")
    splits = splits_from_dataset(parser.parse_args().dataset)
    print(f"hf_finetune baselines, test perplexity ({len(splits['test'][1])} test windows)")
    for name, value in baselines(splits).items():
        print(f"  {name:<32} {value:.1f}")


if __name__ == "__main__":
    main()
