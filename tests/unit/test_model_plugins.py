"""Model plug-ins: built-ins, import paths and entry points build through one resolver; the
meta-device check finds every mistake in one line without allocating weights; the data's
DataSpec comes from the source's headers (probe) and from a written dataset (ranks)."""

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from torch import nn

from tests.unit.test_preprocess_sources import _folder, _npz
from trainflow.errors import ConfigError
from trainflow.flows.config import build_sweep
from trainflow.flows.preflight import preflight
from trainflow.tasks.plugins import PluginError
from trainflow.tasks.preprocess.config import PreprocessConfig
from trainflow.tasks.preprocess.preflight import probe_spec
from trainflow.tasks.preprocess.sources import load_raw
from trainflow.tasks.spec import DataSpec, image_classification
from trainflow.tasks.train.config import TrainConfig
from trainflow.tasks.train.model_plugins import build_model, check_model
from trainflow.tasks.train.models import ReferenceCNN, ResNet, narrowest_conv

SPEC = image_classification((1, 12, 12), 3)
USER_MODELS = """\
import torch
from torch import nn


def build(spec, hidden=8, out=None):
    n = out or spec.num_classes
    return nn.Sequential(nn.Flatten(), nn.Linear(spec.sample_shape[1] * spec.sample_shape[2]
        * spec.sample_shape[0], hidden), nn.ReLU(), nn.Linear(hidden, n))


def huge(spec):
    return nn.Sequential(nn.Flatten(), nn.Linear(144, 200_000), nn.Linear(200_000, 100_000),
        nn.Linear(100_000, spec.num_classes))


def raises(spec):
    raise RuntimeError("no such layer")


def not_a_module(spec):
    return 3


class Broken(nn.Module):
    def forward(self, x):
        return x.view(-1, 7)


def broken_forward(spec):
    return Broken()
"""


@pytest.fixture
def project(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    monkeypatch.syspath_prepend(str(tmp_path))
    (tmp_path / "user_models.py").write_text(USER_MODELS)
    yield tmp_path
    sys.modules.pop("user_models", None)


def test_builtins_build_through_the_resolver_and_width_reaches_only_resnet() -> None:
    cnn = build_model(TrainConfig(model="reference_cnn", width=8), SPEC)
    net = build_model(TrainConfig(model="resnet", width=8), SPEC)
    args = build_model(TrainConfig(model="resnet", model_args={"width": 4}), SPEC)
    assert isinstance(cnn, ReferenceCNN) and isinstance(net, ResNet) and isinstance(args, ResNet)
    assert (narrowest_conv(cnn), narrowest_conv(net), narrowest_conv(args)) == (16, 8, 4)
    assert narrowest_conv(nn.Linear(3, 3)) == 0  # no convolution: channels_last stays off


def test_a_users_factory_gets_the_spec_and_model_args(project: Path) -> None:
    cfg = TrainConfig(model="user_models:build", model_args={"hidden": 5})
    model = build_model(cfg, SPEC)
    assert isinstance(model, nn.Sequential) and model[1].out_features == 5
    report = check_model(cfg, SPEC)
    assert report.parameters == 144 * 5 + 5 + 5 * 3 + 3
    assert report.file == str(project / "user_models.py")
    assert report.params()["model_factory"] == "user_models:build"


def test_the_check_builds_on_meta_so_a_model_larger_than_memory_is_checked(
    project: Path,
) -> None:
    report = check_model(TrainConfig(model="user_models:huge"), SPEC)  # 80 GB in float32
    assert report.parameters > 20_000_000_000 and report.parameter_bytes == 4 * report.parameters


@pytest.mark.parametrize(
    ("model", "args", "needles"),
    [
        ("user_models:raises", {}, ["RuntimeError: no such layer", "user_models.py:17"]),
        ("user_models:build", {"depth": 3}, ["TypeError", "'depth'"]),
        ("user_models:not_a_module", {}, ["returned a int, not a torch.nn.Module"]),
        ("user_models:build", {"out": 5}, ["gives (2, 5)", "needs a tensor of shape (2, 3)"]),
        ("user_models:broken_forward", {}, ["forward pass", "user_models.py:26"]),
        ("user_models:nothing", {}, ["has no 'nothing'"]),
    ],
)
def test_each_mistake_is_one_line_naming_the_users_file(
    project: Path, model: str, args: dict[str, int], needles: list[str]
) -> None:
    with pytest.raises(PluginError) as err:
        check_model(TrainConfig(model=model, model_args=args), SPEC)
    message = str(err.value)
    assert "\n" not in message and "user_models.py" in message, message
    for needle in needles:
        assert needle in message, message


def test_a_builtin_refusing_the_data_says_so_in_its_own_words() -> None:
    vectors = DataSpec((8,), "float32", "regression", None, ())
    with pytest.raises(ConfigError) as err:
        check_model(TrainConfig(), vectors)
    assert "classifies images (C, H, W)" in str(err.value)


def test_entry_points_of_an_installed_distribution(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A real (tiny) installed distribution: importlib.metadata finds its entry_points.txt."""
    site = tmp_path / "site"
    (site / "acme_nets").mkdir(parents=True)
    (site / "acme_nets" / "__init__.py").write_text(USER_MODELS)
    info = site / "acme_nets-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: acme-nets\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text("[trainflow.models]\nacme_mlp = acme_nets:build\n")
    monkeypatch.syspath_prepend(str(site))
    try:
        report = check_model(TrainConfig(model="acme_mlp", model_args={"hidden": 4}), SPEC)
    finally:
        sys.modules.pop("acme_nets", None)
    assert report.target == "acme_nets:build" and report.parameters == 144 * 4 + 4 + 4 * 3 + 3


@pytest.mark.parametrize("source", ["folder", "npz", "synthetic"])
def test_the_probe_tells_the_model_what_the_stage_will_write(tmp_path: Path, source: str) -> None:
    path = {"folder": _folder(tmp_path / "f"), "npz": _npz(tmp_path / "d.npz"), "synthetic": None}
    cfg = PreprocessConfig.model_validate({"source": source, "path": path[source]})
    raw = load_raw(cfg)
    probed = probe_spec(cfg)
    assert probed == image_classification(raw.images.shape[1:], len(raw.classes))
    assert check_model(TrainConfig(model="resnet", width=4), probed).parameters > 0


def test_the_check_is_torch_only_on_meta() -> None:
    """Nothing the check builds lives on a real device."""
    before = torch.zeros(1).device
    check_model(TrainConfig(), SPEC)
    assert torch.zeros(1).device == before


def test_a_sweep_checks_every_elements_model_before_any_work(tmp_path: Path) -> None:
    grid = {"train.model_args": [{}, {"depth": 2}]}
    base, elements = build_sweep("tiny", [f"workdir={tmp_path / 'work'}"], grid)
    preflight(base)  # the base alone is fine
    with pytest.raises(PluginError, match="unexpected keyword argument 'depth'"):
        preflight(base, [cfg.train for _, cfg in elements])
    assert not (tmp_path / "work").exists()
