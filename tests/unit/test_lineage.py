"""Lineage: the dataset as an MLflow dataset input, and the tags a model's runs carry."""

import json
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient
from mlflow.types import TensorSpec

from trainflow.tasks.preprocess.mlflow_dataset import TrainflowDataset, log_dataset_input
from trainflow.tasks.preprocess.ref import DatasetRef
from trainflow.tasks.tracking.lineage import Lineage
from trainflow.tasks.tracking.packages import installed_packages, package_lock_hash


def _ref(tmp_path: Path) -> DatasetRef:
    return DatasetRef(
        path=tmp_path / "ds-abc",
        content_hash="f" * 64,
        counts={"train": 80, "val": 10, "test": 10},
        shape=(1, 28, 28),
        classes=["a", "b"],
        mean=[0.1],
        std=[0.3],
        cache_key="k",
    )


@pytest.mark.services
def test_dataset_input_shows_digest_source_schema_and_profile(tmp_path: Path) -> None:
    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    exp = client.create_experiment("e", artifact_location=(tmp_path / "a").as_uri())
    run_id = client.create_run(exp).info.run_id
    log_dataset_input(client, run_id, _ref(tmp_path), "training")
    inputs = client.get_run(run_id).inputs
    assert inputs is not None
    (logged,) = inputs.dataset_inputs
    ds = logged.dataset
    assert (ds.name, ds.digest, ds.source_type) == ("ds-abc", "f" * 32, "local")
    assert json.loads(ds.source) == {"uri": str(tmp_path / "ds-abc")}
    profile = json.loads(str(ds.profile))
    counts = {"num_samples": 100, "train": 80, "val": 10, "test": 10}
    assert profile == {**counts, "classes": ["a", "b"], "content_hash": "f" * 64}
    spec = json.loads(str(ds.schema))["mlflow_tensorspec"]
    features = json.loads(spec["features"])
    assert features[0]["tensor-spec"] == {"dtype": "uint8", "shape": [-1, 1, 28, 28]}
    assert [(t.key, t.value) for t in logged.tags] == [("mlflow.data.context", "training")]


def test_schema_follows_the_dtypes_and_shapes_the_shards_hold(tmp_path: Path) -> None:
    """Token windows and per-position targets (a sequence dataset), not only images."""
    tokens = {
        "shape": (64,),
        "sample_dtype": "int64",
        "target_shape": (64,),
        "target_dtype": "int64",
    }
    ref = _ref(tmp_path).model_copy(update=tokens)
    schema = TrainflowDataset(ref).schema
    assert schema.targets is not None
    (sample,), (target,) = schema.features.inputs, schema.targets.inputs
    assert isinstance(sample, TensorSpec) and isinstance(target, TensorSpec)
    assert (str(sample.type), sample.shape) == ("int64", (-1, 64))
    assert (str(target.type), target.shape) == ("int64", (-1, 64))


def test_lineage_tags_leave_unknown_parts_out() -> None:
    known = Lineage("d", "c", "h").tags()
    assert known == {"dataset_hash": "d", "git_commit": "c", "config_hash": "h"}
    full = Lineage("d", "c", "h", package_lock_hash="p", code_snapshot_hash="s").tags()
    assert full["package_lock_hash"] == "p" and full["code_snapshot_hash"] == "s"


def test_package_lock_hash_names_the_installed_set() -> None:
    packages = installed_packages()
    assert any(p.startswith("torch==") for p in packages)
    assert package_lock_hash() == package_lock_hash(packages)
    changed = [p for p in packages if not p.startswith("torch==")] + ["torch==0.0.1"]
    assert package_lock_hash(sorted(changed)) != package_lock_hash()


def test_the_installed_set_reads_what_the_full_metadata_says() -> None:
    """Name and Version from the head of each METADATA are what importlib.metadata's email
    parse of the whole file gives, for every distribution installed here."""
    import importlib.metadata
    import sysconfig

    paths = sorted({sysconfig.get_paths()[key] for key in ("purelib", "platlib")})
    dists = list(importlib.metadata.distributions(path=paths))
    parsed = {f"{(d.metadata['Name'] or '').lower()}=={d.version}" for d in dists}
    assert len(dists) > 100 and installed_packages() == sorted(parsed)


def test_the_lock_hash_is_the_environments_not_the_search_paths(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A folder put on sys.path (a working folder, a plug-in's project, a code snapshot) with a
    distribution in it leaves the hash alone: the flow and the ranks see different sys.paths
    but one environment (the full suite once saw the two differ)."""
    before = package_lock_hash()
    info = tmp_path / "stray-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: stray\nVersion: 1.0\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert package_lock_hash() == before
    assert "trainflow==0.1.0" in installed_packages()
