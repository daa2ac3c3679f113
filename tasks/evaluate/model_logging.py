"""Log the trained model to MLflow with signature, input example and explicit requirements."""

import os
from collections.abc import Iterator
from contextlib import contextmanager
from importlib.metadata import version

import mlflow
import numpy as np
import torch
from mlflow.models import infer_signature
from mlflow.tracking._tracking_service import utils as tracking_utils

# Explicit requirements: MLflow otherwise spends ~7 s guessing them by importing the model.
_REQUIREMENTS = ("torch", "numpy", "mlflow")


def pip_requirements() -> list[str]:
    """Pinned requirements of the logged model, read from this environment."""
    return [f"{name}=={version(name).split('+')[0]}" for name in _REQUIREMENTS]


@contextmanager
def use_tracking_uri(uri: str) -> Iterator[None]:
    """Point MLflow's fluent API at `uri` for the block, then restore everything.

    `mlflow.set_tracking_uri` also writes MLFLOW_TRACKING_URI into os.environ (so that child
    processes inherit it). Left behind, that would send every later run of this process, and
    every process it starts (e.g. another pipeline's training ranks), to this run's store.
    """
    env_before = os.environ.get("MLFLOW_TRACKING_URI")
    uri_before = tracking_utils._tracking_uri
    mlflow.set_tracking_uri(uri)
    try:
        yield
    finally:
        # None (nothing set before) is accepted at run time and unsets the variable too.
        tracking_utils.set_tracking_uri(uri_before)  # type: ignore[arg-type]
        if env_before is None:
            os.environ.pop("MLFLOW_TRACKING_URI", None)
        else:
            os.environ["MLFLOW_TRACKING_URI"] = env_before


def log_model(model: torch.nn.Module, example: np.ndarray, tracking_uri: str, run_id: str) -> str:
    """Log ``model`` (eval mode, CPU) to the run; returns the model URI."""
    model = model.cpu().eval()
    with torch.no_grad():
        output = model(torch.from_numpy(example)).numpy()
    signature = infer_signature(example, output)
    # Resuming the run by id is the only way to attach a logged model to an existing run.
    with use_tracking_uri(tracking_uri), mlflow.start_run(run_id=run_id):
        info = mlflow.pytorch.log_model(
            model,
            name="model",
            input_example=example,
            signature=signature,
            pip_requirements=pip_requirements(),
        )
    return str(info.model_uri)
