"""A run trained again from the experiment file its parent run logged, in the code snapshot its
parent run logged, gives the same metrics (same seed, CPU, fp32): real commands, real ranks."""

import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from mlflow.artifacts import download_artifacts
from mlflow.tracking import MlflowClient

pytestmark = pytest.mark.services

MODEL = textwrap.dedent(
    """
    from torch import nn

    def build(spec, hidden=32):
        inputs = 1
        for size in spec.sample_shape:
            inputs *= size
        return nn.Sequential(
            nn.Flatten(), nn.Linear(inputs, hidden), nn.ReLU(), nn.Linear(hidden, spec.num_classes)
        )
    """
)


def _run(argv: list[str], cwd: Path) -> tuple[MlflowClient, str]:
    trainflow = str(Path(sys.executable).with_name("trainflow"))
    out = subprocess.run([trainflow, "run", *argv], cwd=cwd, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-3000:]
    uri = re.search(r"tracking URI\s+(\S+)", out.stdout).group(1)  # type: ignore[union-attr]
    parent = re.search(r"parent run id\s+(\S+)", out.stdout).group(1)  # type: ignore[union-attr]
    return MlflowClient(uri), parent


LEARNT = ("train_loss", "val_", "test_", "lr")
"""What training learnt (losses, accuracies, the schedule): timings differ run to run."""


def _metrics(client: MlflowClient, parent: str) -> dict[str, dict[str, list[float]]]:
    """Per stage run: the history (in step order) of each metric of what was learnt."""
    run = client.get_run(parent)
    kids = client.search_runs([run.info.experiment_id], f"tags.mlflow.parentRunId = '{parent}'")
    found: dict[str, dict[str, list[float]]] = {}
    for kid in kids:
        history = {}
        for key in kid.data.metrics:
            if key.startswith(LEARNT) and not key.endswith("_s"):
                points = client.get_metric_history(kid.info.run_id, key)
                history[key] = [m.value for m in sorted(points, key=lambda m: m.step)]
        found[kid.info.run_name] = history
    return found


def test_the_logged_experiment_file_trains_the_same_run_again(tmp_path: Path) -> None:
    project = tmp_path / "project"
    project.mkdir()
    (project / "my_mlp.py").write_text(MODEL)
    work = tmp_path / "work"
    client, first = _run(
        [
            "--preset", "tiny",
            "--set", f"workdir={work}",
            "--set", "train.model=my_mlp:build",
            "--set", 'train.model_args={"hidden": 24}',
            "--set", "train.precision=fp32",
            "--set", "train.epochs=3",
        ],
        project,
    )  # fmt: skip
    logged = Path(
        download_artifacts(
            run_id=first, tracking_uri=client.tracking_uri, dst_path=str(tmp_path / "got")
        )
    )
    experiment = logged / "experiment.toml"
    text = experiment.read_text()
    assert 'model = "my_mlp:build"' in text and "hidden = 24" in text
    (code,) = {p.parent for p in (logged / "code").rglob("my_mlp.py")}
    # The user's project is gone: the rerun has only what the run logged.
    (project / "my_mlp.py").unlink()
    client, second = _run([str(experiment)], code)
    assert second != first
    before, after = _metrics(client, first), _metrics(client, second)
    assert before["train"]["val_loss"] and len(before["train"]["val_loss"]) == 3
    assert before["evaluate"]["test_accuracy"] and before["train"]["val_accuracy"]
    assert after == before
    again = download_artifacts(
        run_id=second, artifact_path="experiment.toml", tracking_uri=client.tracking_uri,
        dst_path=str(tmp_path / "again"),
    )  # fmt: skip
    body = [line for line in text.splitlines() if not line.startswith("#")]
    assert [
        line for line in Path(again).read_text().splitlines() if not line.startswith("#")
    ] == body
