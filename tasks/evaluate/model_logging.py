"""Log the trained model to MLflow with signature, input example and explicit requirements.

The model is exported (pt2, torch.export) from CPU weights, so it loads anywhere with
``mlflow.pytorch.load_model(uri)`` and moves to a GPU with ``.to("cuda")`` (its graph holds no
device of its own). MLflow's ``device=`` argument and its pyfunc refuse to move a pt2 model off
the device it was exported on, and MLflow checks the input example through its pyfunc on the
default CUDA device when one is visible: that check runs on CPU here, where the weights are,
so it validates on GPU hosts too (it used to fail there) and never initialises CUDA in the
flow process.

A model whose forward returns more than the logits (a transformers ModelOutput, a dict, a
tuple) is exported as its logits (tasks.train.outputs.LogitsOnly): the registered model takes
ids or features and gives one tensor, and loads where transformers is not installed. A
transformers model is also logged as a `save_pretrained` folder (tasks.evaluate.hf_export).
"""

import os
from collections.abc import Iterator
from contextlib import contextmanager
from importlib.metadata import version

import mlflow
import numpy as np
import torch
from mlflow.models import infer_signature

from trainflow.compat import import_mlflow_pytorch
from trainflow.tasks.tracking.runs import use_tracking_uri
from trainflow.tasks.train.outputs import LogitsOnly, logits_of

# Explicit requirements: MLflow otherwise spends ~7 s guessing them by importing the model.
_REQUIREMENTS = ("torch", "numpy", "mlflow")


def pip_requirements() -> list[str]:
    """Pinned requirements of the logged model, read from this environment."""
    return [f"{name}=={version(name).split('+')[0]}" for name in _REQUIREMENTS]


@contextmanager
def _validate_on_cpu() -> Iterator[None]:
    """MLflow's input-example check on CPU (the export's device), restored after."""
    name = "MLFLOW_DEFAULT_PREDICTION_DEVICE"
    before = os.environ.get(name)
    os.environ[name] = "cpu"
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = before


def log_model(model: torch.nn.Module, example: np.ndarray, tracking_uri: str, run_id: str) -> str:
    """Log ``model`` (eval mode, CPU) to the run; returns the model URI."""
    model = model.cpu().eval()
    with torch.no_grad():
        raw = model(torch.from_numpy(example))
    if not isinstance(raw, torch.Tensor):  # a ModelOutput, dict or tuple: export the logits
        model = LogitsOnly(model)
    output = logits_of(raw).numpy()
    signature = infer_signature(example, output)
    # Resuming the run by id is the only way to attach a logged model to an existing run.
    with use_tracking_uri(tracking_uri), _validate_on_cpu(), mlflow.start_run(run_id=run_id):
        info = import_mlflow_pytorch().log_model(
            model,
            name="model",
            input_example=example,
            signature=signature,
            pip_requirements=pip_requirements(),
        )
    return str(info.model_uri)
