"""train.init_from: a source resolved to one weights file, checked against the model before
anything is queued (one line per mistake), and loaded by the ranks right after they build."""

from pathlib import Path

import pytest
import submitit
import torch
from mlflow.tracking import MlflowClient

from tests.unit.datasets import write_dataset
from trainflow.cluster.config import ClusterConfig
from trainflow.cluster.executor import make_executor
from trainflow.cluster.jobs import wait_for_job
from trainflow.errors import ConfigError
from trainflow.tasks.preprocess.ref import DatasetRef, dataset_spec
from trainflow.tasks.train.config import TrainConfig
from trainflow.tasks.train.init_from import check_fits, load_weights, resolve
from trainflow.tasks.train.job import TrainingJob, TrainJobSpec
from trainflow.tasks.train.model_plugins import build_model
from trainflow.tasks.train.ref import CheckpointRef


@pytest.fixture(scope="module")
def dataset(tmp_path_factory: pytest.TempPathFactory) -> DatasetRef:
    return write_dataset(tmp_path_factory.mktemp("data") / "ds")


def _weights(
    dataset: DatasetRef, path: Path, model: str = "reference_cnn", seed: int = 7
) -> dict[str, torch.Tensor]:
    torch.manual_seed(seed)
    weights = build_model(
        TrainConfig(model=model), dataset_spec(dataset, "classification")
    ).state_dict()
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save({"model": weights, "meta": {}}, path)
    return weights


def test_each_kind_of_source_resolves_to_its_weights_file(
    dataset: DatasetRef, tmp_path: Path
) -> None:
    workdir = tmp_path / "work"
    run = workdir / "runs" / "0a1b2c"
    _weights(dataset, run / "best.pt")
    best = (run / "best.pt").resolve()
    assert resolve(str(run / "best.pt"), workdir) == best
    assert resolve(str(run), workdir) == best  # a run folder: its best.pt
    assert resolve("0a1b2c", workdir) == best  # a parent run id under the workdir

    # A registered version: its (evaluate) run's parent is the pipeline run.
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = MlflowClient(uri)
    exp = client.create_experiment("e")
    evaluate = client.create_run(exp, tags={"mlflow.parentRunId": "0a1b2c"}).info.run_id
    client.create_registered_model("cnn")
    client.create_model_version("cnn", source=str(run), run_id=evaluate)
    assert resolve("models:/cnn/1", workdir, uri) == best


@pytest.mark.parametrize(
    ("source", "says"),
    [
        ("nowhere.pt", "no such weights file, run folder, or run under"),
        ("empty-run", "has no best.pt (the run never finished an epoch)"),
        ("models:/cnn", "write models:/<name>/<version number>"),
        ("models:/nope/3", "train.init_from='models:/nope/3': "),
    ],
)
def test_a_source_that_names_no_weights_is_refused_in_one_line(
    tmp_path: Path, source: str, says: str
) -> None:
    (tmp_path / "runs" / "empty-run").mkdir(parents=True)
    with pytest.raises(ConfigError, match=r"^train\.init_from=") as err:
        resolve(source, tmp_path, f"sqlite:///{tmp_path / 'mlflow.db'}")
    assert says in str(err.value) and "\n" not in str(err.value)


def test_weights_of_another_model_are_refused_naming_what_differs(
    dataset: DatasetRef, tmp_path: Path
) -> None:
    path = tmp_path / "mlp.pt"
    _weights(dataset, path, model="mlp")
    with torch.device("meta"):
        cnn = build_model(
            TrainConfig(model="reference_cnn"), dataset_spec(dataset, "classification")
        )
    with pytest.raises(ConfigError, match=r"do not fit this model \(missing: ") as err:
        check_fits(load_weights(path), cnn, path)
    assert "unexpected: " in str(err.value) and str(path) in str(err.value)
    (tmp_path / "junk.pt").write_bytes(b"not a checkpoint")
    with pytest.raises(ConfigError, match=r"junk.pt is not a weights file"):
        load_weights(tmp_path / "junk.pt")


@pytest.mark.services
def test_a_job_starts_from_the_given_weights(dataset: DatasetRef, tmp_path: Path) -> None:
    # A learning rate of 1e-12 and no weight decay leave the weights where they started: the
    # given ones (seed 7), not the job's own seeded build (seed 0).
    given = _weights(dataset, tmp_path / "init.pt")
    cfg = TrainConfig(
        epochs=1, batch_size=32, device="cpu", precision="fp32", lr=1e-12, weight_decay=0.0,
        init_from=str(tmp_path / "init.pt"),
    )  # fmt: skip
    spec = TrainJobSpec(train=cfg, dataset=dataset, out_dir=tmp_path / "run")
    executor: submitit.Executor = make_executor(
        ClusterConfig(executor="debug", ranks_per_node=1), tmp_path / "jobs"
    )
    ref = wait_for_job(executor.submit(TrainingJob(spec)), print)
    assert isinstance(ref, CheckpointRef)
    trained = torch.load(ref.path, weights_only=True)["model"]
    torch.manual_seed(0)
    own = build_model(cfg, dataset_spec(dataset, "classification")).state_dict()
    for name, value in given.items():
        if value.is_floating_point() and "running" not in name:  # BatchNorm's stats move
            torch.testing.assert_close(trained[name], value, rtol=0, atol=1e-6)
    assert any(not torch.equal(given[k], own[k]) for k in given if "weight" in k)


def test_the_command_refuses_weights_that_do_not_fit_before_any_work(
    dataset: DatasetRef, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from trainflow.flows.cli import main

    mlp = tmp_path / "mlp.pt"
    _weights(dataset, mlp, model="mlp")
    work = tmp_path / "work"
    sets = [f"workdir={work}", "train.model=reference_cnn", f"train.init_from={mlp}"]
    assert main(["run", "--preset", "tiny", *(a for s in sets for a in ("--set", s))]) == 2
    err = capsys.readouterr().err
    assert f"trainflow: error: train.init_from: the weights in {mlp} do not fit" in err
    assert not (work / "runs").exists()  # refused before any run
