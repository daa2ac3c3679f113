"""What loading the pipeline flow imports: Prefect and the config, not the stages' libraries.

`prefect deploy`, a served flow's process and Prefect's cancellation-hook process load
flows/pipeline.py only to find the flow; a run imports the stages (flows.pipeline
import_stages: the command, the warm command service and the flow body itself)."""

import subprocess
import sys

_HEAVY = ("torch", "mlflow", "distributed")
_CODE = f"""
import sys
import trainflow.flows.pipeline as p
print(sorted(m for m in {_HEAVY!r} if m in sys.modules))
p.import_stages()
print(sorted(m for m in {_HEAVY!r} if m in sys.modules))
"""


def test_loading_the_flow_leaves_torch_mlflow_and_dask_to_the_stages() -> None:
    out = subprocess.run(
        [sys.executable, "-c", _CODE], capture_output=True, text=True, timeout=120, check=True
    )
    # dask's distributed stays out even then: the preprocess stage imports it when it starts
    # a cluster (an array dataset under 64 MiB runs on threads of this process).
    assert out.stdout.splitlines() == ["[]", "['mlflow', 'torch']"], out.stderr
