"""Pipeline parallelism (train.parallel.pp) against data parallelism: trainflow's own training
job, the built-in transformer (4 blocks, 2 per stage), the same next-token data, seed and
global batch, fp32, SGD with momentum, with clipping, through submitit's local executor (real
gloo ranks).

- pp=2 x dp_shard=2 on 4 ranks against DDP on 2 ranks: the data-parallel ranks of both are 2,
  so each optimizer step sees the same samples; each stage's pipeline splits a rank's batch of
  16 into 2 micro-batches of 8 (the 1F1B schedule).
- pp=2 on 2 ranks against 1 rank; pp=4 (1 block a stage, 8 micro-batches of 2) on 4 ranks
  against 1 rank: the middle stages take neither inputs nor targets.
- a pp=2 x dp_shard=2 run moved to one rank without stages halfway, against DDP.

Bound, and why: the same function, its sums grouped differently. A stage's gradient is the
sum of its micro-batches' backward passes, each loss divided by their number, where the
unsplit batch takes one mean; the pipelined ranks reduce-scatter (FSDP) where DDP
all-reduces; the clipping norm is the root of the stages' summed squares where one rank sums
all squares at once. Each is a rounding difference, ~1e-7 relative in fp32, per step.
Measured over these 12 steps: losses and gradient norms within 9e-8 relative, weights within
1.2e-7 absolute (of weights ~0.1 to 1; pp alone: 3.4e-8 and 6e-8). Bound: 1e-6 for both, eight
times that. SGD with momentum, not AdamW, for test_tensor_parallel's reason: AdamW's
per-element division turns rounding noise in a near-zero gradient into a step of the
learning rate's size, which would test the optimizer, not the split. A loss not divided by
the micro-batches (gradients twice the batch's) fails at once: the gradient norms differ 2x.
"""

import json
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp

from tests.unit.datasets import write_token_dataset
from trainflow.cluster.config import ClusterConfig
from trainflow.cluster.executor import make_executor
from trainflow.cluster.jobs import wait_for_job
from trainflow.tasks.preprocess.ref import DatasetRef, dataset_spec
from trainflow.tasks.train.config import TrainConfig
from trainflow.tasks.train.job import TrainingJob, TrainJobSpec
from trainflow.tasks.train.ref import CheckpointRef
from trainflow.tasks.train.transformer import transformer

pytestmark = [pytest.mark.services, pytest.mark.timeout(300)]
BOUND = 1e-6
CLIP = 0.5


@pytest.fixture(scope="module")
def tokens(tmp_path_factory: pytest.TempPathFactory) -> DatasetRef:
    root = tmp_path_factory.mktemp("tokens") / "ds"
    return write_token_dataset(root, context=32, vocab=40, n_train=768, n_val=128)


COMMON: dict[str, Any] = dict(
    model="transformer",
    model_args={"dim": 64, "layers": 4, "heads": 4},
    objective="sequence",
    device="cpu",
    precision="fp32",
    max_steps=12,
    batch_size=16,
    optimizer="sgd",
    lr=0.1,
    max_grad_norm=CLIP,
    val_every_steps=6,
    test_after_training=False,
)


def train(tokens: DatasetRef, out: Path, ranks: int, **keys: Any) -> dict[str, Any]:
    """Run the job on `ranks` local ranks; its history, best.pt's weights and its newest
    checkpoint."""
    cfg = TrainConfig(**{**COMMON, **keys})
    spec = TrainJobSpec(train=cfg, dataset=tokens, out_dir=out / "run")
    executor = make_executor(ClusterConfig(ranks_per_node=ranks, timeout_min=10), out / "jobs")
    ref = wait_for_job(executor.submit(TrainingJob(spec)), lambda line: None, 0.2)
    assert isinstance(ref, CheckpointRef)
    return {
        "history": json.loads(ref.history_path.read_text()),
        "best": torch.load(ref.path, weights_only=True)["model"],
        "last": max(p for p in (out / "run" / "checkpoints").iterdir() if p.suffix != ".sha256"),
    }


def differences(got: dict[str, Any], want: dict[str, Any]) -> tuple[float, float]:
    """The largest relative difference of the history's losses and norms, and the largest
    absolute difference of best.pt's weights."""
    rel = max(
        abs(g[k] - w[k]) / abs(w[k])
        for g, w in zip(got["history"], want["history"], strict=True)
        for k in ("train_loss", "val_loss", "grad_norm")
    )
    weights = max((got["best"][n] - v).abs().max().item() for n, v in want["best"].items())
    return rel, weights


def assert_same_training(got: dict[str, Any], want: dict[str, Any]) -> None:
    assert [h["step"] for h in got["history"]] == [h["step"] for h in want["history"]] == [6, 12]
    print("differences (relative history, absolute weights):", differences(got, want))
    for g, w in zip(got["history"], want["history"], strict=True):
        for key in ("train_loss", "val_loss", "grad_norm"):
            assert g[key] == pytest.approx(w[key], rel=BOUND), (key, g, w)
        assert g["grad_norm"] > CLIP  # clipped: the norm over every stage's gradients counts
    assert got["best"].keys() == want["best"].keys()
    for name, value in want["best"].items():
        torch.testing.assert_close(got["best"][name], value, rtol=0, atol=BOUND, msg=name)


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # dcp.load in one process
def test_pp2_by_dp_shard2_trains_as_ddp_on_the_same_global_batch(
    tokens: DatasetRef, tmp_path: Path
) -> None:
    ddp = train(tokens, tmp_path / "ddp", 2, strategy="ddp")
    mesh = train(tokens, tmp_path / "mesh", 4, strategy="fsdp", parallel={"pp": 2})
    assert_same_training(mesh, ddp)
    # The stages' sharded checkpoint (DCP) holds the whole model under its own names: it
    # loads into one plain model, with the weights DDP's last checkpoint holds.
    want = torch.load(ddp["last"], weights_only=True)["model"]
    model = transformer(dataset_spec(tokens, "sequence"), dim=64, layers=4, heads=4)
    state = {"model": model.state_dict()}
    dcp.load(state, checkpoint_id=mesh["last"], no_dist=True)
    assert mesh["last"].name == ddp["last"].stem and state["model"].keys() == want.keys()
    for name, value in want.items():
        torch.testing.assert_close(state["model"][name], value, rtol=0, atol=BOUND, msg=name)


# pp=4: stages with neither input nor output (pp=2 alone is the pp=2 x tp=2 test's stages and
# the pp=2 x dp_shard=2 test's schedule: not run on its own, the suite's time)
@pytest.mark.parametrize(
    "parallel", [{"pp": 4, "pp_microbatches": 8}], ids=["pp=4 x 8 micro-batches"]
)
def test_stages_alone_train_as_one_rank(
    tokens: DatasetRef, tmp_path: Path, parallel: dict[str, int]
) -> None:
    one = train(tokens, tmp_path / "one", 1)
    pp = train(tokens, tmp_path / "pp", parallel["pp"], strategy="fsdp", parallel=parallel)
    assert_same_training(pp, one)


def test_a_pipelined_run_continues_on_one_rank_from_its_sharded_checkpoint(
    tokens: DatasetRef, tmp_path: Path
) -> None:
    """Steps 1-6 on pp=2 x dp_shard=2 (4 ranks), 7-12 on one rank without stages (which keeps
    the global batch by accumulating 2 micro-batches), resuming the stages' checkpoint through
    torch.distributed.checkpoint (the weights and SGD's momentum under the whole model's
    names), against 12 straight steps of DDP on 2 ranks: the same bound. Constant learning
    rate, so a longer max_steps changes no step already taken."""
    constant: dict[str, Any] = {"schedule": "constant", "checkpoint_every_steps": 6}
    ddp = train(tokens, tmp_path / "ddp", 2, strategy="ddp", **constant)
    out = tmp_path / "moved"
    train(tokens, out, 4, strategy="fsdp", parallel={"pp": 2}, max_steps=6, **constant)
    moved = train(tokens, out, 1, strategy="fsdp", **constant)
    assert_same_training(moved, ddp)


def test_stages_with_their_layers_split_train_as_one_rank(
    tokens: DatasetRef, tmp_path: Path
) -> None:
    """pp=2 x tp=2 on 4 ranks: each stage splits its own layers over its tp group (sequence
    parallelism included: the stages pass each other their tp rank's part of the sequence)."""
    one = train(tokens, tmp_path / "one", 1)
    both = train(tokens, tmp_path / "both", 4, strategy="fsdp", parallel={"pp": 2, "tp": 2})
    assert_same_training(both, one)
