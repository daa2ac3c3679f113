"""P7: trainflow's training stage vs PyTorch Lightning's Trainer, side by side in one run
(goal: trainflow >= 1.5x Lightning's steady samples/s and <= 0.5x its time to 0.95 test
accuracy, on CPU and on GPU).

Both train the reference CNN on the same dataset (the bundled MNIST subset, written by the
preprocessing stage) with the same optimiser settings (the demo's AdamW, learning rate, weight
decay, batch size per rank and per-step cosine schedule) on the same devices: DDP over the
demo's 2 CPU ranks here, one GPU on a GPU machine. Lightning trains in the precision
trainflow's `auto` picks there (bf16-mixed where the device has bf16, 16-mixed on other GPUs,
32-true otherwise), as a user writes it: a LightningModule, a DataLoader over tensors
(shuffled; Lightning adds the DistributedSampler), `Trainer.fit`, no logger, no checkpoints.

- steady samples/s: trainflow's per-epoch figure of epochs 2..N (P1's measure); Lightning's
  training samples over each epoch's wall time on rank 0, epochs 2..N.
- time to TARGET: both from the moment the bench starts the work (trainflow: submitting the
  job, as in P1; Lightning: starting its process). Lightning's rank 0 tests the model after
  every epoch and the first epoch reaching TARGET counts (its cosine runs over all EPOCHS);
  trainflow's stage runs with 1, 2, ... epochs until its best checkpoint reaches TARGET (P1).
"""

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from bench.p1_training import TARGET, _make_dataset, _run_stage, _time_to_target, _trainflow_configs
from trainflow.tasks.preprocess.dataset import load_split

PRECISION = {"bf16": "bf16-mixed", "fp16": "16-mixed", "fp32": "32-true"}
"""Lightning's name for each precision trainflow's policy may pick."""


def lightning_precision(device: torch.device) -> str:
    """The Lightning precision matching trainflow's `auto` policy on `device`."""
    from trainflow.tasks.train.precision import resolve_precision

    return PRECISION[resolve_precision("auto", device).name]


def _lightning_child(data_dir: Path, out: Path, launched: float) -> None:
    """One Lightning run (each DDP rank runs this; Lightning starts rank 1 itself)."""
    import lightning as L
    import torch.nn.functional as F
    from torch.utils.data import DataLoader, TensorDataset

    from trainflow.flows.config import build_config
    from trainflow.tasks.spec import image_classification
    from trainflow.tasks.train.loop import cosine_lr
    from trainflow.tasks.train.model_plugins import build_model

    demo = build_config("demo")
    train_cfg, cluster = demo.train, demo.cluster
    gpus = torch.cuda.device_count()
    devices = gpus or cluster.ranks_per_node
    torch.set_num_threads(cluster.cpus_per_task)
    x, y = load_split(data_dir, "train")
    x_test, y_test = load_split(data_dir, "test")
    data = TensorDataset(torch.from_numpy(x), torch.from_numpy(y).long())
    loader = DataLoader(data, batch_size=train_cfg.batch_size, shuffle=True)
    steps = train_cfg.epochs * -(-len(data) // (train_cfg.batch_size * devices))

    class Classifier(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = build_model(
                train_cfg, image_classification(tuple(x.shape[1:]), int(y.max()) + 1)
            )

        def training_step(self, batch: Any, _: int) -> torch.Tensor:
            images, labels = batch
            return F.cross_entropy(self.model(images), labels)

        def configure_optimizers(self) -> Any:
            opt = torch.optim.AdamW(
                self.parameters(), lr=train_cfg.lr, weight_decay=train_cfg.weight_decay
            )
            cosine = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: cosine_lr(s, steps, 1.0))
            return {"optimizer": opt, "lr_scheduler": {"scheduler": cosine, "interval": "step"}}

    epochs: list[dict[str, float]] = []

    class Clock(L.Callback):
        def on_train_epoch_start(self, trainer: Any, module: Any) -> None:
            self.start = time.perf_counter()

        def on_train_epoch_end(self, trainer: Any, module: Any) -> None:
            seconds = time.perf_counter() - self.start
            if trainer.global_rank != 0:
                return
            module.model.eval()
            with torch.no_grad():
                images = torch.from_numpy(x_test).to(module.device)
                pred = module.model(images).argmax(1).cpu().numpy()
            module.model.train()
            epochs.append(
                {
                    "epoch_s": seconds,
                    "samples_per_s": len(data) / seconds,
                    "test_accuracy": float((pred == y_test).mean()),
                    "since_launch_s": time.time() - launched,
                }
            )

    device = torch.device("cuda" if gpus else "cpu")
    trainer = L.Trainer(
        accelerator="gpu" if gpus else "cpu",
        devices=devices,
        strategy="ddp" if devices > 1 else "auto",
        precision=lightning_precision(device),  # type: ignore[arg-type]
        max_epochs=train_cfg.epochs,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[Clock()],
    )
    trainer.fit(Classifier(), loader)
    if trainer.global_rank == 0:
        out.write_text(json.dumps({"precision": lightning_precision(device), "epochs": epochs}))


def _run_lightning(data_dir: Path, out: Path) -> dict[str, Any]:
    launched = time.time()
    argv = [sys.executable, "-m", "bench.p7_lightning", "lightning", str(data_dir), str(out)]
    subprocess.run([*argv, str(launched)], check=True, timeout=900, capture_output=True)
    result: dict[str, Any] = json.loads(out.read_text())
    epochs = result["epochs"]
    hit = next((e for e in epochs if e["test_accuracy"] >= TARGET), None)
    result["samples_per_s"] = statistics.median(e["samples_per_s"] for e in epochs[1:])
    result["to_target_s"] = hit and hit["since_launch_s"]
    return result


def run() -> tuple[str, list[tuple[str, str, str]], dict[str, Any]]:
    """Lightning and trainflow on the same data, devices and optimiser settings."""
    load = [os.getloadavg()[0]]
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        dataset = _make_dataset(root / "data")
        train, cluster = _trainflow_configs()
        lit = _run_lightning(dataset.path, root / "lightning.json")
        full = _run_stage(dataset, train, cluster, root / "full")
        search = _time_to_target(dataset, train, cluster, root)
    load.append(os.getloadavg()[0])
    reached = search[-1]["test_accuracy"] >= TARGET
    tf_rate = statistics.median(full["samples_per_s"][1:])
    tf_time = search[-1]["stage_s"] if reached else None
    result = {
        "lightning": lit,
        "trainflow_full": full,
        "trainflow_search": search,
        "trainflow_samples_per_s": tf_rate,
        "trainflow_to_target_s": tf_time,
        "throughput_ratio": tf_rate / lit["samples_per_s"],
        "time_ratio": tf_time / lit["to_target_s"] if tf_time and lit["to_target_s"] else None,
        "load_average_1min": load,
    }
    return "P7 trainflow vs PyTorch Lightning (same model, data, optimiser)", _rows(result), result


def _fmt(value: float | None, spec: str, unit: str = "") -> str:
    return "not reached" if value is None else f"{value:{spec}}{unit}"


def _rows(r: dict[str, Any]) -> list[tuple[str, str, str]]:
    lit = r["lightning"]
    return [
        (f"Lightning samples/s ({lit['precision']})", f"{lit['samples_per_s']:.0f}", ""),
        ("trainflow samples/s", f"{r['trainflow_samples_per_s']:.0f}", ""),
        ("throughput ratio trainflow / Lightning", f"{r['throughput_ratio']:.2f}x", ">= 1.5x"),
        (f"Lightning s to test acc {TARGET} (launch on)",
         _fmt(lit["to_target_s"], ".1f", " s"), ""),
        (f"trainflow s to test acc {TARGET} (submit on)",
         _fmt(r["trainflow_to_target_s"], ".1f", " s"), ""),
        ("time-to-accuracy ratio trainflow / Lightning", _fmt(r["time_ratio"], ".2f"), "<= 0.5"),
        ("machine load, 1-min average at start/end",
         "/".join(f"{v:.1f}" for v in r["load_average_1min"]), "2 cores: noisy above 2"),
    ]  # fmt: skip


if __name__ == "__main__":
    if sys.argv[1:2] == ["lightning"]:
        _lightning_child(Path(sys.argv[2]), Path(sys.argv[3]), float(sys.argv[4]))
