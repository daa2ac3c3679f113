"""A transformers model logged as the folder Hugging Face users load: `save_pretrained`
(safetensors weights, config.json, generation_config.json) plus the tokenizer of the folder the
model was fine-tuned from, when it holds one, as the evaluate run's artifact `huggingface/`.

    from transformers import AutoModelForCausalLM
    folder = mlflow.artifacts.download_artifacts(run_id=run_id, artifact_path="huggingface")
    model = AutoModelForCausalLM.from_pretrained(folder)

The weights are the evaluated ones: the evaluate stage rebuilds the model on the host and loads
the best checkpoint's whole state dict (a sharded run's is gathered to rank 0 when it is
written), so a DDP and an FSDP run export alike.
"""

import tempfile
from pathlib import Path
from typing import Any

from mlflow.tracking import MlflowClient
from torch import nn

from trainflow.tasks.train.outputs import is_transformers_model

ARTIFACT_PATH = "huggingface"
"""Where in the evaluate run's artifacts the save_pretrained folder goes."""
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
"""Either of them in a folder means it holds a tokenizer (fast or configured)."""


def log_pretrained(
    client: MlflowClient, run_id: str, model: nn.Module, model_args: dict[str, Any]
) -> str | None:
    """Log `model` as a save_pretrained folder (with the tokenizer of model_args' pretrained
    folder, if it has one) to `run_id`; its artifact path, or None for a model that is not a
    transformers model."""
    if not is_transformers_model(model):
        return None
    with tempfile.TemporaryDirectory(prefix="trainflow-hf-") as tmp:
        folder = Path(tmp)
        model.cpu().save_pretrained(folder)  # type: ignore[operator]
        source = model_args.get("pretrained")
        if source is not None and any((Path(source) / f).is_file() for f in TOKENIZER_FILES):
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(source, local_files_only=True)
            tokenizer.save_pretrained(folder)
        client.log_artifacts(run_id, str(folder), ARTIFACT_PATH)
    return ARTIFACT_PATH
