"""`trainflow resume`: a run cancelled mid-training and resumed ends with the weights of a run
never cancelled, in the same MLflow runs, from its code snapshot; a finished run is extended;
what may not change is refused in one line. The real command, its real Prefect server and
MLflow store, real rank processes."""

import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from mlflow.tracking import MlflowClient

from tests.services import wait_for_line

pytestmark = pytest.mark.integration

# reference_cnn that sleeps in every training step: the run lasts long enough to be stopped
# after its second epoch, however fast the machine.
SLOW_NET = """\
import time

from torch import nn

from trainflow.tasks.train.models import reference_cnn


class Slow(nn.Module):
    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, x):
        if self.training:
            time.sleep(0.1)
        return self.inner(x)


def build(spec):
    return Slow(reference_cnn(spec))
"""
BROKEN_NET = "def build(spec):\n    raise RuntimeError('edited after the run was submitted')\n"


def _argv(*args: str) -> list[str]:
    return [sys.executable, "-m", "trainflow.flows.cli", *args]


def _run_args(workdir: Path) -> list[str]:
    sets = ["train.model=slow_net:build", "train.epochs=6", "train.precision=fp32"]
    sets += [f"workdir={workdir}"]
    return ["run", "--preset", "tiny", *(a for s in sets for a in ("--set", s))]


def _env(code: Path) -> dict[str, str]:
    return {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": str(code)}


def _command(argv: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, capture_output=True, text=True, env=env, timeout=600)


def _run_folder(workdir: Path) -> Path:
    (folder,) = (workdir / "runs").iterdir()
    return folder


def _last_weights(folder: Path) -> dict[str, torch.Tensor]:
    last = folder / "checkpoints" / "epoch-000006.pt"
    model: dict[str, torch.Tensor] = torch.load(last, weights_only=False)["model"]
    return model


def _runs(workdir: Path, parent: str) -> dict[str, list[Any]]:
    client = MlflowClient(f"sqlite:///{workdir}/mlflow.db")
    exp = client.get_run(parent).info.experiment_id
    found: dict[str, list[Any]] = {}
    for run in client.search_runs([exp]):
        found.setdefault(run.data.tags.get("stage", "parent"), []).append(run)
    return found


def _steps(workdir: Path, run_id: str, key: str) -> list[int]:
    client = MlflowClient(f"sqlite:///{workdir}/mlflow.db")
    return sorted(m.step for m in client.get_metric_history(run_id, key))


def test_a_cancelled_run_resumed_ends_as_a_run_never_cancelled_and_a_finished_one_extends(
    tmp_path: Path,
) -> None:
    code = tmp_path / "code"
    code.mkdir()
    (code / "slow_net.py").write_text(SLOW_NET)
    env = _env(code)
    whole, stopped = tmp_path / "whole", tmp_path / "stopped"
    done = _command(_argv(*_run_args(whole)), env)
    assert done.returncode == 0, done.stderr[-3000:]

    proc = subprocess.Popen(
        _argv(*_run_args(stopped)), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env=env,
    )  # fmt: skip
    try:
        wait_for_line(proc, "epoch 2/6", limit_s=300)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 130
    finally:
        proc.kill()
    folder = _run_folder(stopped)
    parent = folder.name
    assert _runs(stopped, parent)["train"][0].info.status == "KILLED"
    assert not (folder / "checkpoints" / "epoch-000006.pt").exists()
    (code / "slow_net.py").write_text(BROKEN_NET)  # the resume runs the run's snapshot

    resumed = _command(_argv("resume", str(folder)), env)
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    assert f"resuming run {parent} from {folder}" in resumed.stdout
    assert "resuming from" in resumed.stdout + resumed.stderr  # the job took its checkpoint
    expected = _last_weights(_run_folder(whole))
    got = _last_weights(folder)
    assert got.keys() == expected.keys()
    for name, value in expected.items():
        assert torch.equal(got[name], value), name
    runs = _runs(stopped, parent)
    assert [r.info.status for r in runs["parent"]] == ["FINISHED"]  # the same parent run
    (train,) = runs["train"]
    assert train.info.status == "FINISHED"
    assert _steps(stopped, train.info.run_id, "val_loss") == [1, 2, 3, 4, 5, 6]  # none twice
    assert [r.info.status for r in runs["evaluate"]] == ["FINISHED"]

    # The run never cancelled: what may not change is refused, then it is extended.
    by_id = ["resume", _run_folder(whole).name, "--workdir", str(whole)]
    refused = _command(_argv(*by_id, "--set", "train.lr=0.1"), env)
    assert refused.returncode == 2
    assert "trainflow: error: --set train.lr: a resumed run keeps its config" in refused.stderr
    shorter = _command(_argv(*by_id, "--set", "train.epochs=3"), env)
    assert shorter.returncode == 2 and "is below the run's 6" in shorter.stderr
    unknown = _command(_argv("resume", "0123abcd", "--workdir", str(whole)), env)
    assert unknown.returncode == 2 and "no run folder '0123abcd'" in unknown.stderr
    extended = _command(_argv(*by_id, "--set", "train.epochs=8"), env)
    assert extended.returncode == 0, extended.stdout[-3000:] + extended.stderr[-3000:]
    runs = _runs(whole, by_id[1])
    (train,) = runs["train"]
    assert _steps(whole, train.info.run_id, "val_loss") == list(range(1, 9))
    assert runs["parent"][0].data.tags["resumed_with"] == "train.epochs=8"
    assert sorted(r.info.status for r in runs["evaluate"]) == ["FINISHED", "FINISHED"]
