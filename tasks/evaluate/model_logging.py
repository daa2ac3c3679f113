"""Log the trained model to MLflow with signature, input example and explicit requirements."""

from importlib.metadata import version

import mlflow
import numpy as np
import torch
from mlflow.models import infer_signature

from tasks.tracking.runs import use_tracking_uri

# Explicit requirements: MLflow otherwise spends ~7 s guessing them by importing the model.
_REQUIREMENTS = ("torch", "numpy", "mlflow")


def pip_requirements() -> list[str]:
    """Pinned requirements of the logged model, read from this environment."""
    return [f"{name}=={version(name).split('+')[0]}" for name in _REQUIREMENTS]


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
