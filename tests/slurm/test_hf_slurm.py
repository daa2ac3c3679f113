"""A Hugging Face GPT-2 trains as it is by `train.model=hf` on 2 nodes of the dev Slurm (one
rank per node) under FSDP, sharded per GPT2Block, fine-tuned from a save_pretrained folder that
the run names by a path relative to its working folder (as examples/hf_finetune names its
`base-model`: the ranks read it where the command ran), and its save_pretrained export reloads
with the best checkpoint's weights and the registered export's logits, as on the local executor
(tests/integration/test_hf_models.py)."""

import shutil
from pathlib import Path

import mlflow
import pytest
import torch
from mlflow.tracking import MlflowClient
from transformers import AutoConfig, AutoModelForCausalLM

from tests.integration.test_hf_models import (
    CHARLM,
    CONTEXT,
    TINY_GPT2,
    children,
    run,
    split_arrays,
)
from trainflow.tasks.tracking.runs import use_tracking_uri
from trainflow.tasks.train.checkpointing.checkpoint import load_state

TWO_NODES = ["cluster.executor=slurm", "cluster.nodes=2", "cluster.ranks_per_node=1"]


def test_a_gpt2_fine_tunes_sharded_on_two_slurm_nodes_and_its_folder_reloads(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A project folder as a user's: the charlm example's text source, and the model to
    # fine-tune in `base/`, named relative to the folder (a rank that starts elsewhere fails).
    project = tmp_path / "project"
    project.mkdir()
    shutil.copy(CHARLM / "stdlib_text.py", project)
    config = AutoConfig.for_model("gpt2", vocab_size=256, n_positions=CONTEXT, **TINY_GPT2)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(project / "base")
    monkeypatch.chdir(project)
    summary = run(tmp_path / "work", {"pretrained": "base"}, "train.strategy=fsdp", *TWO_NODES)

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
    (best,) = tmp_path.glob("work/runs/*/best.pt")
    trained = load_state(best)["model"]
    for key, value in reloaded.state_dict().items():
        torch.testing.assert_close(value, trained[key], rtol=0, atol=0, msg=key)
    x = split_arrays(tmp_path / "work", "test")[0][:8]
    with torch.no_grad():
        torch.testing.assert_close(reloaded(x).logits, exported(x), rtol=1e-5, atol=1e-5)
