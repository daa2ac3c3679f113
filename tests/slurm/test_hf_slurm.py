"""A Hugging Face GPT-2 built by `train.model=hf` trains as it is on 2 nodes of the dev Slurm
(one rank per node) under FSDP, sharded per GPT2Block, and its save_pretrained export reloads
with the best checkpoint's weights and the registered export's logits, as on the local executor
(tests/integration/test_hf_models.py)."""

from pathlib import Path

import mlflow
import pytest
import torch
from mlflow.tracking import MlflowClient
from transformers import AutoModelForCausalLM

from tests.integration.test_hf_models import CHARLM, TINY_GPT2, children, run, split_arrays
from trainflow.tasks.tracking.runs import use_tracking_uri
from trainflow.tasks.train.checkpoint import load_state

TWO_NODES = ["cluster.executor=slurm", "cluster.nodes=2", "cluster.ranks_per_node=1"]


def test_a_gpt2_trains_sharded_on_two_slurm_nodes_and_its_folder_reloads(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(CHARLM)  # the example's text source imports from its folder
    model_args = {"model_type": "gpt2", **TINY_GPT2}
    summary = run(tmp_path, model_args, "train.strategy=fsdp", *TWO_NODES)

    assert summary.registered_model == "gpt2-sequence" and summary.headline_value < 200
    client = MlflowClient(summary.tracking_uri)
    stages = children(client, summary)
    train = client.get_run(stages["train"]).data.tags
    assert train["slurm_node_list"] == "tfnode[1-2]" and train["slurm_state"] == "COMPLETED"
    with use_tracking_uri(summary.tracking_uri):
        folder = mlflow.artifacts.download_artifacts(
            run_id=stages["evaluate"], artifact_path="huggingface", dst_path=str(tmp_path / "hf")
        )
        exported = mlflow.pytorch.load_model(summary.model_uri)
    reloaded = AutoModelForCausalLM.from_pretrained(folder).eval()
    (best,) = tmp_path.glob("runs/*/best.pt")
    trained = load_state(best)["model"]
    for key, value in reloaded.state_dict().items():
        torch.testing.assert_close(value, trained[key], rtol=0, atol=0, msg=key)
    x = split_arrays(tmp_path, "test")[0][:8]
    with torch.no_grad():
        torch.testing.assert_close(reloaded(x).logits, exported(x), rtol=1e-5, atol=1e-5)
