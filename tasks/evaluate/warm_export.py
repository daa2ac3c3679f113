"""The evaluate stage's model export (pt2 via torch.export, MLflow's pytorch flavor) run in a
fork of the local executor's warm-rank server, where torch._dynamo is imported already.

`torch.export` needs torch._dynamo (1.6-2 s of CPU to import on 2 cores), torch.export._trace
(~1.4 s) and MLflow's pytorch flavor. The flow process needs none of them for anything else:
when this command started a warm-rank server (cluster.warm_ranks), the export runs as
`python -m trainflow.tasks.evaluate.warm_export <request.json>` forked there (the server
imports the export's modules once the job's ranks are forked), on the flow's own stdout and
stderr. Without a server it runs in this process as before. The fork loads the checkpoint
itself (hash checked) and logs the same model to the same run.
"""

import json
import os
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from trainflow.tasks.preprocess.ref import DatasetRef
from trainflow.tasks.train.config import TrainConfig
from trainflow.tasks.train.ref import CheckpointRef


class ExportFailed(RuntimeError):
    """The forked export ended without a model URI (its traceback is on stderr above)."""


def log_model_warm(
    ckpt: CheckpointRef,
    train: TrainConfig,
    dataset: DatasetRef,
    example: np.ndarray,
    tracking_uri: str,
    run_id: str,
    code: Sequence[Path] = (),
) -> str | None:
    """Log the checkpoint's model to `run_id` from a warm fork; its model URI, or None where
    no warm-rank server runs in this process (the caller then logs it itself). The fork
    imports the user's modules from the run's code snapshot folders `code` first, as the
    ranks do: the files in the working folder may have changed since the run was submitted."""
    from trainflow.cluster.warm_pool import running_pool, spawn_warm

    socket_path = running_pool()
    if socket_path is None:
        return None
    with tempfile.TemporaryDirectory(prefix="trainflow-export-") as tmp:
        folder = Path(tmp)
        np.save(folder / "example.npy", example)
        request = {
            "ckpt": ckpt.model_dump_json(),
            "train": train.model_dump_json(),
            "dataset": dataset.model_dump_json(),
            "tracking_uri": tracking_uri,
            "run_id": run_id,
            "code": [str(p) for p in code],
        }
        (folder / "request.json").write_text(json.dumps(request))
        argv = [sys.executable, "-u", "-m", __name__, str(folder)]
        child = spawn_warm(str(socket_path), argv, dict(os.environ))
        if child is None:
            return None
        try:
            status = child.wait()
        except BaseException:  # interrupted: the export must not outlive the flow's wait
            child.kill()
            raise
        result, error = folder / "model_uri.txt", folder / "error.json"
        if error.exists():
            _raise_as_in_process(json.loads(error.read_text()))
        if status != 0 or not result.exists():
            raise ExportFailed(f"the model export (pid {child.pid}) failed with exit code {status}")
        return result.read_text()


def _raise_as_in_process(error: dict[str, Any]) -> None:
    """Raise what the fork raised as this process would have: an OSError with its errno (a
    full disk stays tasks.diskspace's one line), else ExportFailed naming it."""
    if error["errno"] is not None:
        raise OSError(error["errno"], error["strerror"], error["filename"])
    raise ExportFailed(f"the model export failed: {error['type']}: {error['message']}")


def _export(folder: Path) -> None:
    """In the fork: rebuild the model from the checkpoint and log it (model_logging)."""
    from trainflow.cluster.snapshot import code_first
    from trainflow.tasks.evaluate.model_logging import log_model
    from trainflow.tasks.evaluate.run import load_model

    request = json.loads((folder / "request.json").read_text())
    code_first(Path(p) for p in request["code"])  # the code as submitted (cluster.snapshot)
    ckpt = CheckpointRef.model_validate_json(request["ckpt"])
    train = TrainConfig.model_validate_json(request["train"])
    dataset = DatasetRef.model_validate_json(request["dataset"])
    model = load_model(ckpt, train, dataset)
    example = np.load(folder / "example.npy")
    uri = log_model(model, example, request["tracking_uri"], request["run_id"])
    (folder / "model_uri.txt").write_text(uri)


def _main(folder: Path) -> None:
    """_export, its exception also written down for the flow (the traceback goes to stderr)."""
    try:
        _export(folder)
    except Exception as err:
        number = err.errno if isinstance(err, OSError) else None
        record = {"type": type(err).__name__, "message": str(err), "errno": number,
                  "strerror": getattr(err, "strerror", None),
                  "filename": getattr(err, "filename", None)}  # fmt: skip
        (folder / "error.json").write_text(json.dumps(record))
        raise


if __name__ == "__main__":
    _main(Path(sys.argv[1]))
