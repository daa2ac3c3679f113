"""Bad input through the whole flow: a clear error, nothing produced earlier lost or changed."""

import hashlib
from pathlib import Path

import numpy as np
import pytest
from mlflow.tracking import MlflowClient

from trainflow.errors import DataError
from trainflow.flows.pipeline import pipeline

pytestmark = pytest.mark.integration

# One in-process rank keeps the good run cheap; the 2-rank path is covered by test_pipeline.
_FAST = ["cluster.executor=debug", "cluster.ranks_per_node=1", "train.epochs=1"]


def _write_npz(path: Path, nan: bool = False) -> None:
    rng = np.random.default_rng(0)
    images = rng.random((120, 12, 12), dtype=np.float32)
    labels = np.arange(120) % 3
    images[labels == 1] += 1.0
    if nan:
        images[7, 2, 2] = np.nan
    np.savez(path, images=images, labels=labels)


def _tree_digest(root: Path) -> dict[str, str]:
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file() and p.suffix != ".db"
    }


def test_nan_in_npz_fails_clearly_and_keeps_earlier_outputs(tmp_path: Path) -> None:
    data = tmp_path / "raw.npz"
    _write_npz(data)
    work = tmp_path / "work"
    base = [f"workdir={work}", "preprocess.source=npz", f"preprocess.path={data}", *_FAST]
    good = pipeline(preset="tiny", overrides=base)
    before = _tree_digest(work / "datasets")
    _write_npz(data, nan=True)
    with pytest.raises(DataError, match=r"raw\.npz.*(NaN|nan)"):
        pipeline(preset="tiny", overrides=base)
    assert _tree_digest(work / "datasets") == before
    client = MlflowClient(good.tracking_uri)
    assert client.get_run(good.parent_run_id).info.status == "FINISHED"
    exp = client.get_experiment_by_name(good.experiment)
    assert exp is not None
    failed = client.search_runs([exp.experiment_id], "attributes.status = 'FAILED'")
    assert {r.info.run_name for r in failed} == {"tiny", "preprocess"}
