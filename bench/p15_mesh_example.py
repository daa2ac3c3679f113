"""P15: the tensor-parallel example (examples/charlm/charlm_tp.toml) against the same run
without split layers, side by side: `trainflow run` of the example's file as a user runs it,
on 4 local ranks (submitit's local executor: the dev Slurm's nodes are this machine's cores
too), one epoch of a shortened dataset, the same global batch of 64 in every arm:

- tp=2 x dp_shard=2, train.batch_size=32 (the example's layout);
- dp_shard=4 (FSDP2 alone), train.batch_size=16;
- DDP on 4 ranks, train.batch_size=16.

Each arm is a fresh run (its own process, cold); the dataset is built by the first and reused
(content-keyed). Figures from the train run's epoch record (samples/s of the job, MFU over all
ranks' measured peak) and the evaluate stage's test perplexity.
"""

import json
import re
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "charlm"
SHORTER = [
    "cluster.executor=local",
    "cluster.nodes=1",
    "cluster.ranks_per_node=4",
    'preprocess.source_args={"max_files": 12, "context": 64}',
    "train.epochs=1",
    "train.max_steps=1000",
]
ARMS = {
    "tp=2 x dp_shard=2": ["train.batch_size=32"],
    "dp_shard=4": ["train.batch_size=16", "train.parallel.tp=1"],
    "ddp 4": ["train.batch_size=16", "train.strategy=ddp", "train.parallel={}"],
}


def _run(workdir: Path, extra: list[str]) -> dict[str, float]:
    """One `trainflow run` of the example; its epoch's throughput and its test perplexity."""
    argv = [str(Path(sys.executable).with_name("trainflow")), "run", "charlm_tp.toml"]
    for item in [f"workdir={workdir}", *SHORTER, *extra]:
        argv += ["--set", item]
    out = subprocess.run(argv, cwd=EXAMPLE, capture_output=True, text=True, timeout=1200)
    if out.returncode:
        raise RuntimeError(out.stderr[-2000:])
    parent = re.search(r"parent run id\s+(\S+)", out.stdout)
    perplexity = re.search(r"^test perplexity (\S+)", out.stdout, re.M)
    assert parent and perplexity, out.stdout[-2000:]
    history = json.loads((workdir / "runs" / parent.group(1) / "history.json").read_text())
    epoch = history[-1]
    return {
        "samples_per_s": epoch["samples_per_s"],
        "mfu": epoch["mfu"],
        "steps": epoch["step"],
        "test_perplexity": float(perplexity.group(1)),
    }


def run() -> tuple[str, list[tuple[str, str, str]], dict[str, Any]]:
    """The three arms, one after another in one workdir."""
    with tempfile.TemporaryDirectory() as tmp:
        figures = {name: _run(Path(tmp), extra) for name, extra in ARMS.items()}
    base = figures["dp_shard=4"]["samples_per_s"]
    rows = [
        (
            name,
            f"{f['samples_per_s']:.0f} samples/s ({f['samples_per_s'] / base:.2f}x dp_shard=4)",
            f"MFU {f['mfu']:.3f}, test perplexity {f['test_perplexity']:.3f}",
        )
        for name, f in figures.items()
    ]
    ratios = {name: f["samples_per_s"] / base for name, f in figures.items()}
    return "P15: the tensor-parallel example", rows, {"arms": figures, "vs_dp_shard_4": ratios}
