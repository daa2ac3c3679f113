"""A Hugging Face causal language model (GPT-2, 2 tiny layers) trained as it is, without a
wrapper, by the built-in factory `train.model=hf`: on the charlm example's text (the standard
library's sources, every machine has them), 2 local ranks under DDP and under FSDP; the evaluate
stage's save_pretrained folder reloads with `AutoModelForCausalLM.from_pretrained` and gives the
trained model's logits; a run fine-tuned from a saved folder starts from its weights."""

import json
from pathlib import Path

import mlflow
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from mlflow.tracking import MlflowClient
from tokenizers import Tokenizer
from tokenizers.models import WordLevel
from tokenizers.pre_tokenizers import WhitespaceSplit
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerFast

from trainflow.flows.pipeline import PipelineSummary, pipeline
from trainflow.tasks.tracking.runs import use_tracking_uri
from trainflow.tasks.train.checkpointing.checkpoint import load_state

pytestmark = pytest.mark.integration

CHARLM = Path(__file__).parents[2] / "examples" / "charlm"
CONTEXT = 32
TINY_GPT2 = {"n_layer": 2, "n_embd": 32, "n_head": 2}


def run(workdir: Path, model_args: dict[str, object], *extra: str) -> PipelineSummary:
    """The tiny pipeline on the charlm text with train.model=hf, fp32 (comparable losses)."""
    return pipeline(
        preset="tiny",
        overrides=[
            f"workdir={workdir}",
            "preprocess.source=stdlib_text:StdlibText",
            f'preprocess.source_args={{"max_files": 3, "context": {CONTEXT}}}',
            "train.model=hf",
            f"train.model_args={json.dumps(model_args)}",
            "train.objective=sequence",
            "train.precision=fp32",
            *extra,
        ],
    )


def children(client: MlflowClient, summary: PipelineSummary) -> dict[str, str]:
    """Stage name -> run id of the pipeline's child runs."""
    exp = client.get_experiment_by_name(summary.experiment)
    assert exp is not None
    runs = client.search_runs(
        [exp.experiment_id], f"tags.mlflow.parentRunId = '{summary.parent_run_id}'"
    )
    return {r.info.run_name: r.info.run_id for r in runs}


def split_arrays(workdir: Path, split: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids, targets) of a split of the run's dataset, read from its shards."""
    (manifest,) = workdir.glob("datasets/*/manifest.json")
    shards = json.loads(manifest.read_text())["splits"][split]
    x = np.concatenate([np.load(manifest.parent / s["x"]) for s in shards])
    y = np.concatenate([np.load(manifest.parent / s["y"]) for s in shards])
    return torch.from_numpy(x), torch.from_numpy(y)


@pytest.fixture
def in_charlm(monkeypatch: pytest.MonkeyPatch) -> None:
    """The example's folder is the working folder: its source plug-in imports from there."""
    monkeypatch.chdir(CHARLM)


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_a_gpt2_trains_as_it_is_and_its_save_pretrained_folder_reloads(
    tmp_path: Path, in_charlm: None, strategy: str
) -> None:
    summary = run(tmp_path, {"model_type": "gpt2", **TINY_GPT2}, f"train.strategy={strategy}")

    assert summary.headline == "test_perplexity"
    assert summary.headline_value < 200  # 256 byte ids: a uniform guess is 256
    assert summary.registered_model == "gpt2-sequence"
    client = MlflowClient(summary.tracking_uri)
    evaluate = children(client, summary)["evaluate"]
    with use_tracking_uri(summary.tracking_uri):
        folder = mlflow.artifacts.download_artifacts(
            run_id=evaluate, artifact_path="huggingface", dst_path=str(tmp_path / "export")
        )
        exported = mlflow.pytorch.load_model(summary.model_uri)
    assert (Path(folder) / "model.safetensors").is_file()
    reloaded = AutoModelForCausalLM.from_pretrained(folder).eval()
    (best,) = tmp_path.glob("runs/*/best.pt")
    trained = load_state(best)["model"]
    for key, value in reloaded.state_dict().items():
        torch.testing.assert_close(value, trained[key], rtol=0, atol=0, msg=key)
    x = split_arrays(tmp_path, "test")[0][:8]
    with torch.no_grad():
        logits = reloaded(x).logits
        torch.testing.assert_close(logits, exported(x), rtol=1e-5, atol=1e-5)


def test_fine_tuning_starts_from_the_saved_folders_weights(tmp_path: Path, in_charlm: None) -> None:
    """A saved GPT-2 without dropout, trained at a learning rate of 1e-12: the first epoch's
    train loss (every train window once) is the saved model's loss on the train split; the
    folder's tokenizer (one token per byte) comes back with the export."""
    config = AutoConfig.for_model(
        "gpt2",
        vocab_size=256,
        n_positions=CONTEXT,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        **TINY_GPT2,
    )
    torch.manual_seed(1)
    saved = AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():  # trained a little: weights no fresh build has
        for p in saved.parameters():
            p.add_(0.05 * torch.randn_like(p))
    saved.save_pretrained(tmp_path / "saved")
    byte_tokenizer().save_pretrained(tmp_path / "saved")

    summary = run(
        tmp_path / "work",
        {"pretrained": str(tmp_path / "saved")},
        "train.lr=1e-12",
        "train.epochs=1",
    )

    client = MlflowClient(summary.tracking_uri)
    train = client.get_run(children(client, summary)["train"])
    x, y = split_arrays(tmp_path / "work", "train")
    with torch.no_grad():
        logits = saved(x).logits
    expected = F.cross_entropy(logits.reshape(-1, 256), y.reshape(-1)).item()
    assert train.data.metrics["train_loss"] == pytest.approx(expected, rel=1e-5)
    with use_tracking_uri(summary.tracking_uri):
        folder = mlflow.artifacts.download_artifacts(
            run_id=children(client, summary)["evaluate"],
            artifact_path="huggingface",
            dst_path=str(tmp_path / "export"),
        )
    tokenizer = AutoTokenizer.from_pretrained(folder)
    assert tokenizer("b0 41")["input_ids"] == [0xB0, 0x41]


def byte_tokenizer() -> PreTrainedTokenizerFast:
    """A word-level tokenizer whose 256 words are the bytes' hex names (as StdlibText's classes)."""
    vocab = {f"{b:02x}": b for b in range(256)}
    tokenizer = Tokenizer(WordLevel(vocab, unk_token="00"))
    tokenizer.pre_tokenizer = WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="00")
