"""What loading the pipeline flow imports: Prefect and the config, not the stages' libraries.

`prefect deploy`, a served flow's process and Prefect's cancellation-hook process load
flows/pipeline.py only to find the flow; the stages import torch, MLflow and dask when a run
reaches them."""

import subprocess
import sys

import pytest

_HEAVY = ("torch", "mlflow", "distributed")
_CODE = f"""
import sys
import trainflow.flows.pipeline
print(sorted(m for m in {_HEAVY!r} if m in sys.modules))
"""


@pytest.mark.services
def test_loading_the_flow_leaves_torch_mlflow_and_dask_to_the_stages() -> None:
    out = subprocess.run(
        [sys.executable, "-c", _CODE], capture_output=True, text=True, timeout=120, check=True
    )
    assert out.stdout.splitlines() == ["[]"]
