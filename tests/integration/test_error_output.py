"""Errors arrive fast and alone: bad input that needs no pixels is refused before any server or
cluster starts; an error found inside a stage shows as its one line, tracebacks only on demand."""

import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from prefect.settings import get_current_settings

from tests.disks import tmpfs
from tests.services import service_env
from tests.unit.test_preprocess_sources import _folder, _save_image

# What a terminal shows of the command run cold, as a user without the stack runs it.
pytestmark = pytest.mark.integration


def _run(
    *overrides: str,
    debug: bool = False,
    env_add: dict[str, str] | None = None,
    cwd: Path | None = None,
    preset: str = "tiny",
) -> subprocess.CompletedProcess[str]:
    argv = [sys.executable, "-m", "trainflow.flows.cli", *(["--debug"] if debug else []), "run"]
    argv += ["--preset", preset]
    for item in overrides:
        argv += ["--set", item]
    env = {k: v for k, v in service_env().items() if k != "TRAINFLOW_DEBUG"}
    api = get_current_settings().api.url  # the session's test server: no second one to start
    if api:
        env["PREFECT_API_URL"] = api
    env.update(env_add or {})
    return subprocess.run(argv, capture_output=True, text=True, timeout=600, env=env, cwd=cwd)


def _mixed_sizes(tmp: Path) -> tuple[Path, str]:
    root = _folder(tmp / "imgs")
    _save_image(root / "dog" / "big.png", "RGB", size=(20, 16))
    return root, r"big.png' is 16x20"


def _text_npz(tmp: Path) -> tuple[Path, str]:
    (tmp / "data.npz").write_text("images,labels\n1,2\n")
    return tmp / "data.npz", "data.npz': it is not an .npz archive"


def _float_labels(tmp: Path) -> tuple[Path, str]:
    rng = np.random.default_rng(0)
    np.savez(tmp / "f.npz", images=rng.random((40, 8, 8)), labels=np.arange(40) * 0.5)
    return tmp / "f.npz", "'labels' has dtype float64; expected integers"


@pytest.mark.parametrize("make", [_mixed_sizes, _text_npz, _float_labels])
def test_bad_input_is_refused_alone_before_any_server_starts(tmp_path: Path, make: object) -> None:
    assert callable(make)
    path, message = make(tmp_path)
    source = "npz" if path.suffix == ".npz" else "folder"
    work = tmp_path / "work"
    out = _run(f"preprocess.source={source}", f"preprocess.path={path}", f"workdir={work}")
    assert out.returncode == 2, out.stderr
    assert out.stderr.count("\n") == 1 and out.stderr.startswith("trainflow: error: ")
    assert message in out.stderr and "allow_pickle" not in out.stderr
    assert out.stdout == ""
    assert not work.exists()  # no Prefect server, MLflow store or dask cluster was started


@pytest.fixture
def three_mib_disk(tmp_path: Path) -> Iterator[Path]:
    """A 3 MiB tmpfs: a disk that fills up in the middle of a write (numpy's short write)."""
    yield from tmpfs(tmp_path / "three", "3m")


def test_a_workdir_too_small_for_the_dataset_is_refused_before_any_server(
    three_mib_disk: Path,
) -> None:
    # The demo's MNIST takes ~7.5 MiB at its peak (staged pixels beside the shards): known
    # before anything is read, so no server, dask cluster or half-written file.
    out = _run(f"workdir={three_mib_disk}/work", preset="demo")
    assert out.returncode == 2, out.stderr
    assert out.stderr.count("\n") == 1, out.stderr
    assert out.stderr.startswith(
        f"trainflow: error: preprocess: not enough space on the disk of {three_mib_disk}/work/"
        "datasets (3.0 MiB free, about 7.5 MiB needed): free some space there, or set workdir"
    )
    assert not any(three_mib_disk.iterdir())


def test_an_error_inside_a_stage_shows_once_without_tracebacks(tmp_path: Path) -> None:
    root = _folder(tmp_path / "imgs")
    good = (root / "cat" / "c0.png").read_bytes()
    (root / "cat" / "c0.png").write_bytes(good[: len(good) // 2])  # found only by decoding
    out = _run("preprocess.source=folder", f"preprocess.path={root}", f"workdir={tmp_path}/w")
    text = out.stdout + out.stderr
    assert out.returncode == 2, text[-3000:]
    assert "Traceback" not in text, text[-3000:]
    assert text.count("cannot read image") == 1, text[-3000:]
    lines = out.stderr.splitlines()
    assert any(line.startswith("trainflow: error: cannot read image") for line in lines), text


@pytest.fixture(scope="module")
def failing_workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One workdir for the failing-rank runs: the second reuses the first one's dataset."""
    return tmp_path_factory.mktemp("failing-ranks")


_RANK_ERROR = re.compile(
    r"trainflow: error: job \S+ failed in rank (\d)(?:, then rank\(s\) \[\d\])?: "
    r"rank \1 on node \S+ raised (.*), log: (\S+_\1_log\.err)"
)


def _rank_error(out: subprocess.CompletedProcess[str]) -> tuple[str, Path]:
    """What the failed rank raised and its log, from the one error line."""
    assert out.returncode == 2, (out.stdout + out.stderr)[-3000:]
    lines = [line for line in out.stderr.splitlines() if line.startswith("trainflow: error: ")]
    assert len(lines) == 1, out.stderr[-3000:]
    match = _RANK_ERROR.fullmatch(lines[0])
    assert match, lines[0]
    return match.group(2), Path(match.group(3))


def test_a_rank_that_raises_a_trainflow_error_says_what_in_one_line(failing_workdir: Path) -> None:
    # The flow's host may lack the GPUs nodes have: device=cuda is refused in the ranks.
    out = _run("train.device=cuda", f"workdir={failing_workdir}")
    raised, log = _rank_error(out)
    assert raised.startswith("ConfigError: train.device=cuda but this process sees no usable GPU")
    text = out.stdout + out.stderr
    assert "Traceback" not in text and "File " not in text  # in the rank's log, not the console
    assert "Traceback (most recent call last)" in log.read_text()


def test_a_rank_that_raises_any_python_error_says_what_in_one_line(failing_workdir: Path) -> None:
    # A node without a working C++ compiler: torch.compile fails in the ranks, not in the flow;
    # torch's excepthook prints the traceback once more, each line prefixed '[rank0]:'.
    out = _run(
        "train.compile=true", f"workdir={failing_workdir}", env_add={"CXX": "/nonexistent/c++"}
    )
    raised, log = _rank_error(out)
    assert raised.startswith("InductorError: InvalidCxxCompiler: No working C++ compiler"), raised
    assert "/nonexistent/c++" in raised
    text = out.stdout + out.stderr
    assert "Traceback" not in text and "File " not in text  # in the rank's log, not the console
    assert "Traceback (most recent call last)" in log.read_text()


_USER_MODELS = """\
from torch import nn


def wrong_width(spec):
    return nn.Sequential(nn.Flatten(), nn.LazyLinear(spec.num_classes + 1))


def raises(spec, depth=1):
    raise ValueError(f"depth {depth} is too deep")


NOT_CALLABLE = 3
"""


@pytest.mark.parametrize(
    ("model", "message"),
    [
        ("no_such_models:build", "no module named 'no_such_models'"),
        ("user_models:NOT_CALLABLE", "'NOT_CALLABLE' in "),
        ("user_models:raises", "raised ValueError: depth 4 is too deep at "),
        ("user_models:wrong_width", "gives (2, 4) for a batch of 2"),
    ],
)
def test_a_model_plugin_mistake_is_refused_alone_before_any_server_starts(
    tmp_path: Path, model: str, message: str
) -> None:
    """Run from the user's project folder, as a user would: the module is found there."""
    (tmp_path / "user_models.py").write_text(_USER_MODELS)
    work = tmp_path / "work"
    out = _run(
        f"train.model={model}",
        'train.model_args={"depth": 4}' if model.endswith("raises") else "train.model_args={}",
        "preprocess.source=synthetic",
        "preprocess.synthetic_classes=3",
        f"workdir={work}",
        cwd=tmp_path,
    )
    assert out.returncode == 2, out.stderr
    assert out.stderr.count("\n") == 1 and out.stderr.startswith("trainflow: error: "), out.stderr
    assert message in out.stderr and "Traceback" not in out.stderr
    if model.startswith("user_models"):
        assert str(tmp_path / "user_models.py") in out.stderr
    assert out.stdout == ""
    assert not work.exists()  # no Prefect server, MLflow store or dask cluster was started
