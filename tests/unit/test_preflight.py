"""Pre-flight checks: every bad input that needs no pixels is refused before any work starts,
with the same message the preprocess stage gives for it; what needs pixels is left to the stage."""

import os
import re
import subprocess
import sys
import threading
import uuid
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from tests.unit.test_preprocess_sources import _folder, _npz, _save_image
from trainflow.cluster.slurm_checks import unreachable_hint
from trainflow.errors import ConfigError, DataError
from trainflow.flows.preflight import check_workdir
from trainflow.tasks.preprocess.config import PreprocessConfig
from trainflow.tasks.preprocess.preflight import preflight_source
from trainflow.tasks.preprocess.sources import load_raw
from trainflow.tasks.preprocess.validate import validate_raw

Build = Callable[[Path], PreprocessConfig]


def _folder_case(edit: Callable[[Path], Path]) -> Build:
    def build(tmp: Path) -> PreprocessConfig:
        return PreprocessConfig(source="folder", path=edit(_folder(tmp / "data")))

    return build


def _npz_case(make: Callable[[Path], Path]) -> Build:
    return lambda tmp: PreprocessConfig(source="npz", path=make(tmp))


def _write(file: Path, content: bytes) -> Path:
    file.parent.mkdir(parents=True, exist_ok=True)
    file.write_bytes(content)
    return file


def _emu(root: Path) -> Path:
    (root / "emu").mkdir()
    (root / "emu" / "readme.txt").write_text("no images here")
    return root


def _big_dog(root: Path) -> Path:
    _save_image(root / "dog" / "big.png", "RGB", size=(20, 16))
    return root


def _one_class(root: Path) -> Path:
    for f in (root / "dog").iterdir():
        f.unlink()
    (root / "dog").rmdir()
    for i in range(6, 12):
        _save_image(root / "cat" / f"c{i}.png", "L", seed=i)
    return root


def _two_per_class(root: Path) -> Path:
    for f in sorted((root / "cat").glob("*.png"))[2:] + sorted((root / "dog").glob("*.jpg"))[2:]:
        f.unlink()
    return root


def _mixed_npz(tmp: Path) -> Path:
    _npz(tmp / "mixed" / "a.npz")
    _npz(tmp / "mixed" / "b.npz", images=np.zeros((12, 9, 9), np.uint8))
    return tmp / "mixed"


def _objects_npz(tmp: Path) -> Path:
    path = tmp / "objects.npz"
    np.savez(path, images=np.array([{"x": 1}] * 12, dtype=object), labels=np.arange(12) % 3)
    return path


def _no_npz(tmp: Path) -> Path:
    (tmp / "none").mkdir()
    (tmp / "none" / "a.txt").write_text("x")
    return tmp / "none"


NEG = np.arange(12) % 3 - 1
OUT_OF_RANGE = np.where(np.arange(12) == 5, 7, np.arange(12) % 3)
# Each case: the input, and a pattern both the pre-flight check and the stage's message match.
CASES: dict[str, tuple[Build, str]] = {
    "empty image": (
        _folder_case(lambda r: _write(r / "cat" / "bad.png", b"").parent.parent),
        r"bad\.png.* is empty",
    ),
    "not an image": (
        _folder_case(lambda r: _write(r / "cat" / "bad.png", b"garbage").parent.parent),
        r"cannot read image .*bad\.png",
    ),
    "mixed sizes": (
        _folder_case(_big_dog),
        r"big\.png.*16x20.*10x12.*image_size=\[10,12\]",
    ),
    "empty class": (_folder_case(_emu), r"class folder .*emu.* holds no"),
    "no class folders": (
        _folder_case(lambda r: r / "cat"),
        "no class folders",
    ),
    "one class": (_folder_case(_one_class), r"at least 2 distinct class names, got \['cat'\]"),
    "too few": (_folder_case(_two_per_class), "only 4 samples"),
    "path is a file": (
        _folder_case(lambda r: r / "cat" / "c0.png"),
        r"c0\.png' is not a folder",
    ),
    "empty npz": (_npz_case(lambda t: _write(t / "zero.npz", b"")), r"zero\.npz.* is empty"),
    "text npz": (
        _npz_case(lambda t: _write(t / "text.npz", b"hello\n")),
        r"text\.npz.*not an \.npz archive",
    ),
    "junk zip": (
        _npz_case(lambda t: _write(t / "junk.npz", b"PK\x03\x04 no zip")),
        r"cannot read npz file .*junk\.npz",
    ),
    "objects": (_npz_case(_objects_npz), r"objects\.npz.*'images'"),
    "count": (
        _npz_case(lambda t: _npz(t / "count.npz", labels=np.arange(11) % 3)),
        r"count\.npz.*12 images but 11 labels",
    ),
    "ndim": (
        _npz_case(lambda t: _npz(t / "ndim.npz", images=np.zeros((12, 64)))),
        r"ndim\.npz.*\(12, 64\)",
    ),
    "empty images": (
        _npz_case(lambda t: _npz(t / "e.npz", images=np.zeros((0, 8, 8)), labels=np.zeros(0, int))),
        r"e\.npz.*'images' is empty",
    ),
    "float labels": (
        _npz_case(lambda t: _npz(t / "float.npz", labels=np.arange(12) * 0.5)),
        r"float\.npz.*expected integers",
    ),
    "negative": (_npz_case(lambda t: _npz(t / "neg.npz", labels=NEG)), r"neg\.npz.*label -1"),
    "out of range": (
        _npz_case(lambda t: _npz(t / "r.npz", labels=OUT_OF_RANGE, classes=np.array(list("abc")))),
        r"r\.npz.*label 7 is out of range for the 3 classes",
    ),
    "mixed shapes": (_npz_case(_mixed_npz), r"b\.npz.*\(1, 9, 9\).*a\.npz"),
    "no npz files": (_npz_case(_no_npz), r"no \.npz files in folder"),
    "unused class": (
        _npz_case(lambda t: _npz(t / "gap.npz", labels=np.arange(12) % 2 * 2)),
        r"classes without any sample: \['1'\]",
    ),
}
# The stage words these differently (numpy's own errors); pre-flight is the clearer one.
_PREFLIGHT_ONLY = {"objects", "text npz"}


def _stage_error(cfg: PreprocessConfig) -> str:
    """The message the preprocess stage itself gives (loading, then validating)."""
    with pytest.raises(DataError) as info:
        validate_raw(load_raw(cfg), str(cfg.path))
    return str(info.value)


@pytest.mark.parametrize("case", sorted(CASES))
def test_preflight_refuses_what_the_stage_refuses_with_its_message(
    tmp_path: Path, case: str
) -> None:
    build, pattern = CASES[case]
    cfg = build(tmp_path)
    with pytest.raises(DataError, match=pattern) as info:
        preflight_source(cfg)
    assert "allow_pickle" not in str(info.value)  # numpy's advice: pickles run code
    if case not in _PREFLIGHT_ONLY:
        stage = _stage_error(cfg)
        assert re.search(pattern, stage), stage


def test_object_arrays_are_refused_without_unpickling_advice(tmp_path: Path) -> None:
    with pytest.raises(DataError, match="never unpickles") as info:
        preflight_source(_npz_case(_objects_npz)(tmp_path))
    assert "allow_pickle" not in str(info.value)


def test_npz_missing_key_names_the_keys(tmp_path: Path) -> None:
    path = tmp_path / "nolabels.npz"
    np.savez(path, images=np.zeros((12, 8, 8)), y=np.zeros(12))
    with pytest.raises(DataError, match=r"nolabels\.npz.*\['labels'\].*'y'"):
        preflight_source(PreprocessConfig(source="npz", path=path))


@pytest.mark.parametrize("source", ["folder", "npz"])
def test_good_data_passes(tmp_path: Path, source: str) -> None:
    if source == "folder":
        cfg = PreprocessConfig(source="folder", path=_folder(tmp_path / "data"))
    else:
        rgb = np.zeros((10, 8, 8, 3))
        _npz(tmp_path / "m" / "a.npz", n=10, images=rgb, labels=np.arange(10) % 4)
        _npz(tmp_path / "m" / "b.npz", n=6, images=rgb[:6], labels=np.arange(6) % 4)
        cfg = PreprocessConfig(source="npz", path=tmp_path / "m")
    preflight_source(cfg)
    validate_raw(load_raw(cfg), "good")  # and the stage agrees


def test_what_needs_pixels_is_left_to_the_stage(tmp_path: Path) -> None:
    """A truncated image and NaN pass pre-flight (no pixel is read there); the stage refuses."""
    root = _folder(tmp_path / "data")
    good = (root / "cat" / "c0.png").read_bytes()
    (root / "cat" / "c0.png").write_bytes(good[: len(good) // 2])
    folder = PreprocessConfig(source="folder", path=root)
    nan = np.zeros((12, 8, 8), np.float32)
    nan[3, 2, 1] = np.nan
    npz = PreprocessConfig(source="npz", path=_npz(tmp_path / "nan.npz", images=nan))
    for cfg, pattern in ((folder, r"c0\.png"), (npz, "NaN")):
        preflight_source(cfg)
        with pytest.raises(DataError, match=pattern):
            validate_raw(load_raw(cfg), "stage")


def test_workdir_that_is_a_file_is_refused(tmp_path: Path) -> None:
    (tmp_path / "f").write_text("x")
    with pytest.raises(ConfigError, match="is a file, not a folder"):
        check_workdir(tmp_path / "f" / "work")
    check_workdir(tmp_path / "new" / "work")  # created later, under a writable folder


def test_slurm_unreachable_hint_names_slurm_conf_and_the_env_command(tmp_path: Path) -> None:
    unset = unreachable_hint({})
    assert "SLURM_CONF is not set" in unset and "cluster/dev/slurm.sh env" in unset
    missing = unreachable_hint({"SLURM_CONF": str(tmp_path / "nope.conf")})
    assert "nope.conf does not exist" in missing
    (tmp_path / "slurm.conf").write_text("ClusterName=x\n")
    silent = unreachable_hint({"SLURM_CONF": str(tmp_path / "slurm.conf")})
    assert "slurmctld" in silent and "trainflow cluster status" in silent
    assert all("executor=local" in hint for hint in (unset, missing, silent))


_USER_MODEL = """\
from torch import nn


def wrong_width(spec):
    return nn.Sequential(nn.Flatten(), nn.LazyLinear(spec.num_classes + 1))
"""


@pytest.mark.parametrize("mistake", ["data", "model", "global batch"])
def test_the_command_refuses_bad_data_a_bad_model_or_batch_before_it_starts_any_process(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    mistake: str,
) -> None:
    """`trainflow run` checks the data, the global batch on the job's ranks and the user's
    model before it starts Prefect's temporary server or any job: the refusal is one line and
    nothing was started."""
    from trainflow.flows import cli

    monkeypatch.delenv("PREFECT_API_URL", raising=False)  # else no temporary server would start
    argv = ["run", "--preset", "tiny", "--set", f"workdir={tmp_path}"]
    if mistake == "data":
        (tmp_path / "data.npz").write_text("images,labels\n")
        argv += ["--set", "preprocess.source=npz", "--set", f"preprocess.path={tmp_path}/data.npz"]
        said = "it is not an .npz archive"
    elif mistake == "global batch":  # tiny: 2 ranks x 32 do not make up 96 samples a step
        argv += ["--set", "train.global_batch_size=96"]
        said = "train.global_batch_size=96 is not a whole number of micro-batches"
    else:
        (tmp_path / "tf_user_models.py").write_text(_USER_MODEL)
        monkeypatch.syspath_prepend(str(tmp_path))
        argv += ["--set", "train.model=tf_user_models:wrong_width"]
        said = "gives (2, 5) for a batch of 2"

    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and said in err, err
    assert not (tmp_path / "runs").exists()  # no job folder
    assert "prefect-temporary-server" not in {t.name for t in threading.enumerate()}


@pytest.mark.services
@pytest.mark.parametrize("debug", [False, True])
def test_a_model_refused_by_the_command_is_one_line_and_leaves_no_process(
    tmp_path: Path, debug: bool
) -> None:
    """The command (a process of its own, as users start it) checks the model before anything
    starts: a mistake is one line and exit 2, and no process is left; --debug shows the
    traceback from the user's file."""
    import psutil

    (tmp_path / "tf_user_models.py").write_text(_USER_MODEL)
    marker = uuid.uuid4().hex
    env = {**os.environ, "PYTHONPATH": str(tmp_path), "TRAINFLOW_TEST_MARK": marker}
    env.pop("PREFECT_API_URL", None)
    argv = [sys.executable, "-m", "trainflow.flows.cli", *(["--debug"] if debug else []),
            "run", "--preset", "tiny", "--set", f"workdir={tmp_path / 'work'}",
            "--set", "train.model=tf_user_models:wrong_width"]  # fmt: skip
    out = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=180)
    assert out.returncode == 2, out.stderr
    assert out.stdout == ""
    said = "gives (2, 5) for a batch of 2"
    if debug:
        assert "Traceback" in out.stderr and "tf_user_models.py" in out.stderr, out.stderr
    else:
        assert out.stderr.count("\n") == 1 and said in out.stderr, out.stderr
    assert said in out.stderr.splitlines()[-1]

    def marked(proc: psutil.Process) -> bool:
        try:
            return proc.environ().get("TRAINFLOW_TEST_MARK") == marker
        except psutil.Error:
            return False

    assert [p for p in psutil.process_iter() if marked(p)] == []  # no server or job
