"""A search's space and its refusals: each mistake one line, exit 2, before any job."""

from pathlib import Path

import optuna
import pytest

from trainflow.errors import ConfigError
from trainflow.flows import cli
from trainflow.tasks.search.config import SearchConfig
from trainflow.tasks.search.space import grid_values, parse_space
from trainflow.tasks.search.study import make_ref, open_study


def test_each_kind_parses_into_its_optuna_distribution() -> None:
    space = parse_space(
        [
            "train.lr=loguniform(1e-4, 1e-1)",
            "train.weight_decay=uniform(0,0.1)",
            "train.batch_size=choice(32,64,128)",
            "train.epochs=int(1,3)",
        ]
    )
    dists = {p.key: p.distribution() for p in space}
    assert dists["train.lr"] == optuna.distributions.FloatDistribution(1e-4, 1e-1, log=True)
    assert dists["train.weight_decay"] == optuna.distributions.FloatDistribution(0, 0.1)
    assert dists["train.batch_size"] == optuna.distributions.CategoricalDistribution([32, 64, 128])
    assert dists["train.epochs"] == optuna.distributions.IntDistribution(1, 3)
    # Written back as given: the MLflow param and the summary show the same text.
    assert [p.text() for p in space][:1] == ["loguniform(0.0001,0.1)"]
    # A Python list is a choice; the grid sampler takes choices and int ranges.
    (listed,) = parse_space({"train.optimizer": ["adamw", "sgd"]})
    assert listed.choices == ("adamw", "sgd")
    assert grid_values(space[2:]) == {"train.batch_size": [32, 64, 128], "train.epochs": [1, 2, 3]}


@pytest.mark.parametrize(
    ("space", "says"),
    [
        ("train.lr=uniform(0.1,0.01)", "empty or inverted"),
        ("train.lr=uniform(0.1,0.1)", "empty or inverted"),
        ("train.lr=loguniform(0,0.1)", "log range needs both bounds above 0"),
        ("train.lr=gauss(0,1)", "write one of"),
        ("train.lr=uniform(a,b)", "JSON values"),
        ("train.width=int(1.5,4)", "two integers"),
        ("train.lr", "not of the form"),
        ("preprocess.shard_size=int(64,128)", "only train.* keys"),
        ("train.batch_size=choice()", "at least one value"),
    ],
)
def test_a_malformed_space_is_refused(space: str, says: str) -> None:
    with pytest.raises(ConfigError, match=says):
        parse_space([space])


def test_the_grid_sampler_refuses_a_float_range(tmp_path: Path) -> None:
    cfg = SearchConfig(space={"train.lr": "uniform(0.001,0.01)"}, sampler="grid")
    with pytest.raises(ConfigError, match="grid sampler needs choice"):
        make_ref(cfg, tmp_path, "local", "x", "val_accuracy", True)
    # A grid's size caps the budget: the sampler has no more points.
    cfg = SearchConfig(space={"train.lr": "choice(0.001,0.01)"}, sampler="grid", trials=9)
    assert make_ref(cfg, tmp_path, "local", "x", "val_accuracy", True).trials == 2


def test_a_slurm_search_refuses_sqlite(tmp_path: Path) -> None:
    cfg = SearchConfig(space={"train.lr": "uniform(0.001,0.01)"})
    with pytest.raises(ConfigError, match="needs a database every node reaches"):
        make_ref(cfg, tmp_path, "slurm", "x", "val_accuracy", True)


def _refused(tmp_path: Path, capsys: pytest.CaptureFixture[str], *args: str) -> str:
    argv = ["sweep", "--preset", "tiny", "--set", f"workdir={tmp_path / 'w'}", *args]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("trainflow: error: ") and err.count("\n") == 0, err
    assert not (tmp_path / "w" / "runs").exists()  # no run, no job
    return err


def test_an_unknown_key_is_refused_with_the_key_meant(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    err = _refused(tmp_path, capsys, "--space", "train.learning_rate=loguniform(1e-4,1e-1)")
    assert "train.learning_rate" in err and "unknown key" in err and "train.lr" in err


def test_a_choice_of_the_wrong_type_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    err = _refused(tmp_path, capsys, "--space", 'train.batch_size=choice(32,"big")')
    assert "train.batch_size" in err and "'big'" in err
    err = _refused(tmp_path, capsys, "--space", "train.batch_size=uniform(16,64)")
    assert "train.batch_size" in err and "does not fit" in err


def test_an_inverted_range_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    err = _refused(tmp_path, capsys, "--space", "train.lr=loguniform(0.1,0.001)")
    assert "train.lr" in err and "empty or inverted" in err


def test_a_storage_that_cannot_be_reached_or_written_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    space = ["--space", "train.lr=loguniform(1e-4,1e-1)"]
    url = "postgresql+psycopg://search:secret@127.0.0.1:1/studies"  # nothing listens on port 1
    err = _refused(tmp_path, capsys, *space, "--storage", url)
    assert "cannot be reached or written" in err and "secret" not in err and "127.0.0.1" in err
    locked = tmp_path / "locked"
    locked.mkdir()
    (locked / "optuna.db").write_text("not a database")
    err = _refused(tmp_path, capsys, *space, "--storage", f"sqlite:///{locked / 'optuna.db'}")
    assert "cannot be reached or written" in err


def test_a_pruner_without_a_validation_metric_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    err = _refused(
        tmp_path,
        capsys,
        "--space",
        "train.lr=uniform(0.001,0.01)",
        "--pruner",
        "median",
        "--set",
        "preprocess.val_fraction=0",
    )
    assert "--pruner median needs the validation metric val_accuracy" in err


def test_grid_and_space_together_are_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    err = _refused(
        tmp_path, capsys, "--space", "train.lr=uniform(0.001,0.01)", "--grid", "train.lr=[0.1]"
    )
    assert "--grid or --space" in err


def test_the_same_study_opens_again_with_its_trials(tmp_path: Path) -> None:
    cfg = SearchConfig(space={"train.lr": "uniform(0.001,0.01)"}, study="s")
    ref = make_ref(cfg, tmp_path, "local", "x", "val_accuracy", True)
    study = open_study(ref)
    study.enqueue_trial({"train.lr": 0.005})
    assert len(open_study(ref).trials) == 1
