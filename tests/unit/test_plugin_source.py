"""Source plug-ins on a real dask cluster: a user's module lists and reads parts, trainflow
does the rest (validation, splits, shards, statistics, manifest), and every failure in the
user's code is one line naming the part, the source and their file."""

import sys
from collections.abc import Iterator
from pathlib import Path

import distributed
import numpy as np
import pytest

from trainflow.cluster.dask import Backend
from trainflow.errors import DataError
from trainflow.tasks.plugins import PluginError
from trainflow.tasks.preprocess.config import PreprocessConfig
from trainflow.tasks.preprocess.dataset import load_manifest, load_raw_split, load_split
from trainflow.tasks.preprocess.preflight import probe_spec
from trainflow.tasks.preprocess.ref import DatasetRef, dataset_spec
from trainflow.tasks.preprocess.run import run_preprocess
from trainflow.tasks.preprocess.sources import fingerprint

MODULE = "tf_user_sources"
SOURCES = '''
import numpy as np


class Features:
    """Regression: (n, 4) float64 features, (n, 2) targets; one part per row range."""

    def __init__(self, rows=240, parts=3, bad_part=-1, wide_part=-1):
        step = rows // parts
        self.ranges = [(i * step, (i + 1) * step) for i in range(parts)]
        self.bad_part, self.wide_part = bad_part, wide_part

    def parts(self):
        return self.ranges

    def fingerprint(self, part):
        return f"rows {part}"

    def read(self, part):
        index = self.ranges.index(part)
        if index == self.bad_part:
            raise ValueError("row 7 has a broken quote")
        rng = np.random.default_rng(part[0])
        x = rng.normal(3.0, 5.0, size=(part[1] - part[0], 5 if index == self.wide_part else 4))
        return x, np.stack([x[:, 0] * 2 + 1, x[:, 1] - x[:, 2]], axis=1)


class Tokens:
    """Next-token windows of length 8 over a vocabulary of 11 ids."""

    def parts(self):
        return ["a.txt", "b.txt"]

    def fingerprint(self, part):
        return part

    def read(self, part):
        ids = np.arange(200) * (3 if part == "a.txt" else 5) % 11
        windows = np.lib.stride_tricks.sliding_window_view(ids, 9)[::2]
        return windows[:, :-1].astype(np.int32), windows[:, 1:]


class NoRead:
    def parts(self):
        return [0]

    def fingerprint(self, part):
        return "0"
'''


@pytest.fixture(scope="module")
def user_project(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A user's project folder on sys.path before the dask workers start (they inherit it)."""
    folder = tmp_path_factory.mktemp("project")
    (folder / f"{MODULE}.py").write_text(SOURCES)
    sys.path.insert(0, str(folder))
    yield folder
    sys.path.remove(str(folder))
    sys.modules.pop(MODULE, None)


def _cfg(name: str, **args: object) -> PreprocessConfig:
    return PreprocessConfig(source=f"{MODULE}:{name}", source_args=args, shard_size=64)


def _run(cfg: PreprocessConfig, out: Path, dask: tuple[distributed.Client, Backend]) -> DatasetRef:
    client, backend = dask
    return run_preprocess(cfg, out, client, backend, fingerprint(cfg))


def test_features_and_float_targets_are_sharded_and_normalised_per_feature(
    user_project: Path, dask_cpu: tuple[distributed.Client, Backend], tmp_path: Path
) -> None:
    cfg = _cfg("Features")
    ref = _run(cfg, tmp_path, dask_cpu)
    assert sum(ref.counts.values()) == 240 and ref.shape == (4,)
    assert ref.target_shape == (2,) and ref.target_dtype == "float32"
    assert ref.normalisation == "per_feature" and ref.num_classes is None and ref.classes == []
    manifest = load_manifest(ref.path)
    assert manifest["dtype"] == {"x": "float32", "y": "float32"}
    x, y = load_split(ref.path, "train")
    assert x.shape == (ref.counts["train"], 4) and y.shape == (ref.counts["train"], 2)
    np.testing.assert_allclose(x.mean(axis=0), 0.0, atol=1e-5)  # per-feature statistics
    np.testing.assert_allclose(x.std(axis=0), 1.0, atol=1e-4)
    raw, _y = load_raw_split(ref.path, "train")
    np.testing.assert_allclose(y[:, 0], raw[:, 0] * 2 + 1, rtol=1e-5)  # rows stay paired
    assert ref.content_hash == _run(cfg, tmp_path / "again", dask_cpu).content_hash
    spec = dataset_spec(ref, "regression")
    assert spec == probe_spec(cfg, "regression")  # preflight's headers-only view agrees
    assert spec.sample_dtype == "float32" and spec.output_shape(3) == (3, 2)


def test_token_ids_are_not_normalised_and_their_vocabulary_is_recorded(
    user_project: Path, dask_cpu: tuple[distributed.Client, Backend], tmp_path: Path
) -> None:
    ref = _run(_cfg("Tokens"), tmp_path, dask_cpu)
    assert ref.shape == (8,) and ref.target_shape == (8,) and ref.num_classes == 11
    assert ref.normalisation == "none" and ref.mean == [] and ref.sample_dtype == "int64"
    x, y = load_split(ref.path, "test")
    assert x.dtype == np.int64 and y.dtype == np.int64
    np.testing.assert_array_equal(x[:, 1:], y[:, :-1])  # ids as read: targets shifted by one
    spec = dataset_spec(ref, "sequence")
    assert spec.sample_dtype == "int64" and spec.output_shape(2) == (2, 8, 11)


def test_a_part_that_raises_is_named_with_the_source_and_the_users_line(
    user_project: Path, dask_cpu: tuple[distributed.Client, Backend], tmp_path: Path
) -> None:
    cfg = _cfg("Features", bad_part=1)
    with pytest.raises(DataError) as err:
        _run(cfg, tmp_path, dask_cpu)
    message = str(err.value)
    assert "part '(80, 160)' of source 'tf_user_sources:Features'" in message, message
    assert "ValueError: row 7 has a broken quote" in message
    assert f"{user_project / MODULE}.py:22" in message and "\n" not in message
    assert not list(tmp_path.iterdir()), "nothing is published"
    with pytest.raises(DataError, match="part '\\(0, 80\\)'"):  # preflight reads part 0
        probe_spec(_cfg("Features", bad_part=0))


def test_parts_that_disagree_name_the_part(
    user_project: Path, dask_cpu: tuple[distributed.Client, Backend], tmp_path: Path
) -> None:
    with pytest.raises(DataError, match=r"part '\(160, 240\)'.*differ from.*part '\(0, 80\)'"):
        _run(_cfg("Features", wide_part=2), tmp_path, dask_cpu)


def test_the_fingerprint_follows_the_parts_and_the_arguments(user_project: Path) -> None:
    base = fingerprint(_cfg("Features"))
    assert base == fingerprint(_cfg("Features"))
    assert base != fingerprint(_cfg("Features", parts=4))  # other parts
    assert base != fingerprint(_cfg("Features", bad_part=2))  # other arguments


def test_a_source_without_the_protocol_or_module_is_one_line(user_project: Path) -> None:
    with pytest.raises(PluginError, match=r"NoRead in .*tf_user_sources\.py lacks \['read'\]"):
        probe_spec(_cfg("NoRead"))
    with pytest.raises(PluginError, match="no module named 'nope'"):
        probe_spec(PreprocessConfig(source="nope:Source"))
    with pytest.raises(PluginError, match=r"the source plug-in .* raised TypeError"):
        probe_spec(_cfg("Tokens", rows=3))


def test_the_built_in_arrays_source_goes_through_the_same_seam(
    dask_cpu: tuple[distributed.Client, Backend], tmp_path: Path
) -> None:
    rng = np.random.default_rng(0)
    for name, n in (("a", 30), ("b", 50)):
        x = rng.normal(size=(n, 2, 3)).astype(np.float32)
        np.savez(tmp_path / f"{name}.npz", inputs=x, targets=x.sum(axis=(1, 2)))
    cfg = PreprocessConfig(source="arrays", source_args={"path": str(tmp_path)}, shard_size=64)
    ref = _run(cfg, tmp_path / "out", dask_cpu)
    assert sum(ref.counts.values()) == 80 and ref.shape == (2, 3) and ref.target_shape == ()
    assert ref.normalisation == "per_channel" and len(ref.mean) == 2
    np.savez(tmp_path / "b.npz", inputs=np.zeros((5, 2, 3)), labels=np.zeros(5))
    with pytest.raises(DataError, match=r"b\.npz.*lacks \['targets'\]"):
        _run(cfg, tmp_path / "out2", dask_cpu)
