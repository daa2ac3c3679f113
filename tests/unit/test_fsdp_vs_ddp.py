"""trainflow's own training job (its loop, AdamW, its cosine schedule, its evaluation) under
train.strategy=fsdp against the same job under ddp: 2 gloo ranks each through submitit's local
executor, the charlm transformer on the same next-token data and seed, 2 epochs. The fp32 jobs
clip the gradients (train.max_grad_norm below their norm): each epoch's mean global gradient
norm (grad_norm) must agree too.

Bounds, and why:
- fp32: the same computation; only the order of the gradient reduction differs (FSDP's
  reduce-scatter against DDP's all-reduce: rounding, ~1e-7 relative per step). Validation
  and training losses of each epoch within 1e-5 relative; best.pt's weights within 1e-5,
  but for the attention's key bias (in_proj_bias[DIM:2*DIM]): its gradient is 0 in exact
  arithmetic (a constant added to every key shifts each query's scores alike, which softmax
  ignores), so what it gets is rounding noise, which AdamW divides by its own magnitude
  (~eps) into steps of ~lr/10. The clip's norm, summed in another order under FSDP, differs in
  its last bits, the runs then differ at rounding level, and so does that noise: measured
  2e-4 apart after 2 epochs (without clipping the two 2-rank runs compute alike to 1e-6).
- bf16: FSDP gathers each block's parameters in bf16 and runs the block on them (its
  MixedPrecisionPolicy; gradients reduced and master weights kept in fp32), so its forward is
  bf16 throughout: embeddings, residual stream, norms. DDP runs bf16 autocast over fp32
  weights, which does the matmuls in bf16 and keeps the residual stream and norms in fp32.
  bf16 rounds each value to 8 significant bits (relative 2^-9 to 2^-8), and those roundings
  change each step's gradient a little, so the runs drift apart slowly. Measured here: 3e-4
  relative after 2 epochs (bench P10: 5e-5 after 8 steps). Bound: 1% of the validation loss
  after 2 epochs (docs/training.md). FSDP with bf16 master weights (the model cast to bf16
  before sharding) ends epoch 1 5% off: outside it. Why FSDP does not compute as DDP does
  (fp32 parameters under autocast): that keeps a bf16 copy of every weight of every block
  from the forward pass to the backward pass on every rank, which P10 measures, and which is
  the memory FSDP exists to save.
"""

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.unit.datasets import write_token_dataset
from trainflow.cluster.config import ClusterConfig
from trainflow.cluster.executor import make_executor
from trainflow.cluster.jobs import wait_for_job
from trainflow.tasks.preprocess.ref import DatasetRef
from trainflow.tasks.train.config import TrainConfig
from trainflow.tasks.train.job import TrainingJob, TrainJobSpec
from trainflow.tasks.train.precision import device_supports_bf16
from trainflow.tasks.train.ref import CheckpointRef

pytestmark = [pytest.mark.services, pytest.mark.timeout(300)]
CHARLM = Path(__file__).resolve().parents[2] / "examples" / "charlm"
BOUND = {"fp32": 1e-5, "bf16": 1e-2}
CLIP = 0.3
DIM = 64  # the model's width


@pytest.fixture(scope="module")
def tokens(tmp_path_factory: pytest.TempPathFactory) -> DatasetRef:
    root = tmp_path_factory.mktemp("tokens") / "ds"
    return write_token_dataset(root, context=32, vocab=40, n_train=2048, n_val=256)


def _train(
    tokens: DatasetRef, out: Path, strategy: str, precision: str, max_grad_norm: float
) -> dict[str, Any]:
    cfg = TrainConfig(
        model="char_transformer:build",
        model_args={"dim": DIM, "layers": 2, "heads": 2, "dropout": 0.0},
        objective="sequence",
        strategy=strategy,
        precision=precision,
        device="cpu",
        epochs=2,
        batch_size=32,
        lr=3e-3,
        max_grad_norm=max_grad_norm,
        test_after_training=False,
    )
    spec = TrainJobSpec(train=cfg, dataset=tokens, out_dir=out / "run", code=[CHARLM])
    executor = make_executor(ClusterConfig(ranks_per_node=2, timeout_min=10), out / "jobs")
    ref = wait_for_job(executor.submit(TrainingJob(spec)), lambda line: None, 0.2)
    assert isinstance(ref, CheckpointRef)
    return {
        "history": json.loads(ref.history_path.read_text()),
        "best": torch.load(ref.path, weights_only=True)["model"],
    }


# train.precision=bf16 is refused where bf16 cannot run at all (an AVX2-only CPU such as
# AMD Zen 2): that case skips, naming why; trainflow's own refusal is tested in test_precision.
NO_BF16 = pytest.mark.skipif(
    not device_supports_bf16(torch.device("cpu")),
    reason="this CPU runs no bf16 (neither native nor emulated): train.precision=bf16 refused",
)


@pytest.mark.parametrize(
    "precision,max_grad_norm", [("fp32", CLIP), pytest.param("bf16", 0.0, marks=NO_BF16)]
)
def test_the_fsdp_job_trains_as_the_ddp_job_does_within_the_precisions_bound(
    tokens: DatasetRef, tmp_path: Path, precision: str, max_grad_norm: float
) -> None:
    ddp = _train(tokens, tmp_path / "ddp", "ddp", precision, max_grad_norm)
    fsdp = _train(tokens, tmp_path / "fsdp", "fsdp", precision, max_grad_norm)
    bound = BOUND[precision]
    assert [h["step"] for h in fsdp["history"]] == [h["step"] for h in ddp["history"]]
    for want, got in zip(ddp["history"], fsdp["history"], strict=True):
        assert got["lr"] == want["lr"]
        assert got["val_loss"] == pytest.approx(want["val_loss"], rel=bound), (want, got)
        assert got["train_loss"] == pytest.approx(want["train_loss"], rel=bound)
        if max_grad_norm:
            assert got["grad_norm"] == pytest.approx(want["grad_norm"], rel=bound)
            assert got["grad_norm"] > max_grad_norm  # the mean norm: most steps clipped
        else:
            assert "grad_norm" not in got
    if precision == "fp32":
        assert ddp["best"].keys() == fsdp["best"].keys()
        for name, value in ddp["best"].items():
            got = fsdp["best"][name]
            if name.endswith("attn.in_proj_bias"):  # the key bias (below) left out
                got, value = (
                    torch.cat([got[:DIM], got[2 * DIM :]]),
                    torch.cat([value[:DIM], value[2 * DIM :]]),
                )
            torch.testing.assert_close(got, value, rtol=0, atol=1e-5)
