"""Experiment files: the config as TOML, applied between the preset and --set; mistakes named
with their file and line; the rendered file of a config builds that config again."""

from pathlib import Path

import pytest

from trainflow.errors import ConfigError
from trainflow.flows.cli import main
from trainflow.flows.config import PRESETS, build_config, build_sweep
from trainflow.flows.experiment import key_lines, read, render

LM = """\
preset = "tiny"
name = "lm"   # a comment

[preprocess]
source = "stdlib_text:StdlibText"
source_args = { max_files = 8, context = 32 }

[train]
model = "char_transformer:build"
objective = "sequence"
epochs = 3
[train.model_args]
dim = 32
layers = 1
"""


def _write(tmp_path: Path, text: str, name: str = "exp.toml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def test_the_file_sits_between_its_preset_and_the_command_line(tmp_path: Path) -> None:
    path = _write(tmp_path, LM)
    cfg = build_config(None, [], path)
    assert cfg.name == "lm" and cfg.train.epochs == 3
    assert cfg.preprocess.source_args == {"max_files": 8, "context": 32}
    assert cfg.train.model_args == {"dim": 32, "layers": 1}
    # From the file's preset, tiny, where the file says nothing:
    assert cfg.train.batch_size == PRESETS["tiny"]()["train"]["batch_size"] == 32
    over = build_config(None, ["train.epochs=5", "train.model_args={}"], path)
    assert over.train.epochs == 5 and over.train.model_args == {}  # --set replaces, as ever
    demo = build_config("demo", [], path)  # --preset beats the file's preset
    assert demo.train.batch_size == build_config("demo").train.batch_size != 32
    assert demo.train.epochs == 3


def test_an_unknown_key_is_named_with_its_line_and_the_key_meant(tmp_path: Path) -> None:
    path = _write(tmp_path, LM.replace("epochs = 3", "epoch = 3"))
    with pytest.raises(ConfigError) as err:
        build_config(None, [], path)
    (line,) = str(err.value).splitlines()[1:]
    assert line.strip().startswith(
        f"{path}:11: train.epoch: unknown key (did you mean train.epochs?)"
    )


def test_bad_values_are_named_where_the_file_sets_them(tmp_path: Path) -> None:
    text = 'train.lr = -1\n[cluster]\nranks_per_node = "two"\n[preprocess]\nsource_args = {a = 1}\n'
    path = _write(tmp_path, text)
    with pytest.raises(ConfigError) as err:
        build_config(None, [], path)
    said = str(err.value)
    assert f"{path}:1: train.lr: Input should be greater than 0" in said
    assert f"{path}:3: cluster.ranks_per_node:" in said
    # The same mistake made on the command line names no file line:
    with pytest.raises(ConfigError) as err2:
        build_config(None, ["train.lr=-2"], path)
    assert "\n  train.lr: Input should be greater than 0 (got -2)" in str(err2.value)


@pytest.mark.parametrize(
    ("text", "said"),
    [
        ("[train\nepochs = 3\n", "not valid TOML"),
        ('preset = "huge"\n', "unknown preset 'huge'"),
        ("preset = 3\n", "exp.toml:1: preset must be a preset's name"),
    ],
)
def test_a_file_that_cannot_be_read_is_one_line(tmp_path: Path, text: str, said: str) -> None:
    with pytest.raises(ConfigError, match=said) as err:
        build_config(None, [], _write(tmp_path, text))
    assert "\n" not in str(err.value)


def test_a_missing_file_is_one_line(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"experiment file .*nope.toml does not exist"):
        build_config(None, [], tmp_path / "nope.toml")


def test_key_lines_follow_tables_dotted_keys_and_multiline_arrays() -> None:
    text = 'a = 1\nb.c = 2\n[d]\ne = [\n  1,\n  "f = 3",\n]\ng = 4\n[d."h.i"]\nj = 5\n'
    assert key_lines(text) == {
        "a": 1,
        "b.c": 2,
        "d": 3,
        "d.e": 4,
        "d.g": 8,
        "d.h.i": 9,
        "d.h.i.j": 10,
    }


@pytest.mark.parametrize("preset", list(PRESETS))
def test_a_rendered_config_builds_the_same_config(tmp_path: Path, preset: str) -> None:
    overrides = [
        "train.model_args={'depth': 2, 'act': 'gelu'}".replace("'", '"'),
        "train.width=24",
        "cluster.timeout_min=30",
        "preprocess.synthetic_shape=[1, 8, 8]",
        "preprocess.source=my_data:Reader",
        'preprocess.source_args={"team": "vision", "n": [1, 2]}',
    ]
    cfg = build_config(preset, overrides)
    path = _write(tmp_path, render(cfg, "a header\nof two lines"))
    assert path.read_text().startswith("# a header\n# of two lines\n")
    assert read(path).preset is None  # no preset key: every key is in the file
    assert build_config(None, [], path) == cfg
    assert build_config(preset, [], path) == cfg


def test_config_prints_a_file_that_runs_the_same_config(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["config", "--preset", "tiny", "--set", "train.epochs=7", "--format", "toml"]) == 0
    path = _write(tmp_path, capsys.readouterr().out)
    assert main(["config", str(path)]) == 0
    again = build_config(None, [], path)
    assert again == build_config("tiny", ["train.epochs=7"]) and again.train.epochs == 7


def test_the_command_refuses_a_bad_file_with_one_line_and_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = _write(tmp_path, "[train]\nepochz = 3\n")
    assert main(["run", str(path)]) == 2
    err = capsys.readouterr().err
    assert f"{path}:2: train.epochz: unknown key (did you mean train.epochs?)" in err


def test_a_sweep_varies_the_grid_over_the_file(tmp_path: Path) -> None:
    base, elements = build_sweep(
        None, ["train.epochs=4"], {"train.lr": [0.01, 0.1]}, _write(tmp_path, LM)
    )
    assert base.name == "lm" and base.train.epochs == 4
    assert [cfg.train.lr for _, cfg in elements] == [0.01, 0.1]
    assert all(cfg.train.model == "char_transformer:build" for _, cfg in elements)
    assert all(cfg.train.epochs == 4 for _, cfg in elements)


@pytest.mark.parametrize("off", ["false", "null"])
def test_registration_turned_off_stays_off_through_a_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], off: str
) -> None:
    """TOML has no null: `trainflow config --format toml` writes `registered_model = false`,
    and the file it prints builds a config that registers nothing, as does a file that says
    false itself."""
    argv = ["config", "--preset", "tiny", "--set", f"evaluate.registered_model={off}"]
    assert main([*argv, "--format", "toml"]) == 0
    printed = capsys.readouterr().out
    assert "registered_model = false" in printed
    path = _write(tmp_path, printed)
    assert build_config(None, [], path).evaluate.registered_model is None
    assert build_config(None, [], path) == build_config(
        "tiny", [f"evaluate.registered_model={off}"]
    )
    own = _write(tmp_path, 'preset = "tiny"\n[evaluate]\nregistered_model = false\n', "own.toml")
    assert build_config(None, [], own).evaluate.registered_model is None
    assert main(["config", str(own)]) == 0
    assert '"registered_model": false' in capsys.readouterr().out
