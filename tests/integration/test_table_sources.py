"""Data as users keep it, trained end to end: a Parquet file of text with a tokenizer folder
(a language model learns its next tokens) and a Hugging Face dataset saved to disk (a
classifier learns its classes), through the whole pipeline (preprocess on dask, training on 2
rank processes, evaluation, MLflow); and bad input refused by `trainflow run` in one line
before any job."""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from mlflow.tracking import MlflowClient

from tests.tables import numeric_table, stdlib_documents, train_tokenizer, write_text_parquet
from trainflow.flows.pipeline import PipelineSummary, pipeline

pytestmark = pytest.mark.integration

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")


def _metrics(uri: str, parent: str) -> dict[str, dict[str, float]]:
    client = MlflowClient(uri)
    run = client.get_run(parent)
    kids = client.search_runs([run.info.experiment_id], f"tags.mlflow.parentRunId = '{parent}'")
    return {str(k.data.tags.get("stage")): k.data.metrics for k in kids}


def test_a_language_model_trains_on_parquet_text_with_a_tokenizer_folder(tmp_path: Path) -> None:
    train_on_parquet_text(tmp_path, [])


def train_on_parquet_text(tmp_path: Path, extra: list[str]) -> PipelineSummary:
    """The whole pipeline on a Parquet file of text with a tokenizer folder (overrides
    `extra` on top), checked: it learnt, with the tokenizer's vocabulary."""
    docs = stdlib_documents(count=60, max_chars=4000)
    tokenizer = train_tokenizer(tmp_path / "tokenizer", docs, vocab=300)
    data = write_text_parquet(tmp_path / "data" / "text.parquet", docs, rows_per_group=15)
    args = {"path": str(data), "inputs": "text", "tokenizer": str(tokenizer), "context": 32}
    summary = pipeline(
        preset="tiny",
        overrides=[
            f"workdir={tmp_path / 'work'}",
            "preprocess.source=parquet",
            f"preprocess.source_args={json.dumps(args)}",
            "train.model=token_conv",
            "train.objective=sequence",
            "train.epochs=2",
            *extra,
        ],
    )
    assert summary.headline == "test_perplexity"
    stages = _metrics(summary.tracking_uri, summary.parent_run_id)
    # 300 ids: a model that learnt nothing has a perplexity near 300; a unigram model ~100.
    assert stages["evaluate"]["test_perplexity"] < 60, stages["evaluate"]
    print(f"parquet text: test perplexity {stages['evaluate']['test_perplexity']:.1f}")
    (manifest,) = (tmp_path / "work" / "datasets").glob("*/manifest.json")
    written = json.loads(manifest.read_text())
    assert written["num_classes"] == 300 and written["shape"] == [32]
    return summary


def test_a_classifier_trains_on_a_saved_hugging_face_dataset(tmp_path: Path) -> None:
    import datasets

    table = numeric_table(1200, features=6, classes=3, seed=1)
    features = np.stack([table.column(f"f{i}").to_numpy() for i in range(6)], 1)
    saved = datasets.Dataset.from_dict({"features": features.tolist(), "label": table["label"]})
    saved.save_to_disk(str(tmp_path / "saved"), num_shards=2)
    args = {"path": str(tmp_path / "saved"), "inputs": "features", "target": "label"}
    summary = pipeline(
        preset="tiny",
        overrides=[
            f"workdir={tmp_path / 'work'}",
            "preprocess.source=hf_dataset",
            f"preprocess.source_args={json.dumps({**args, 'rows_per_part': 300})}",
            "train.model=mlp",
            "train.objective=classification",
            "train.epochs=3",
        ],
    )
    assert summary.headline == "test_accuracy"
    assert summary.headline_value > 0.8, summary  # 3 separable classes; chance is 1/3
    print(f"saved dataset: test accuracy {summary.headline_value:.3f}")
    (manifest,) = (tmp_path / "work" / "datasets").glob("*/manifest.json")
    written = json.loads(manifest.read_text())
    assert sum(written["counts"].values()) == 1200 and written["shape"] == [6]


def test_bad_table_input_is_one_line_before_any_job(tmp_path: Path) -> None:
    import pyarrow.parquet as pq

    data = tmp_path / "num.parquet"
    pq.write_table(numeric_table(100), data)
    base = {"path": str(data), "inputs": ["f0", "f1"], "target": "label"}
    cases: dict[str, tuple[dict[str, object], str]] = {
        "a missing column": ({"target": "class"}, "no column 'class'"),
        "a column of the wrong type": ({"inputs": ["f0", "name"]}, "column 'name' (an input)"),
        "no tokenizer folder": (
            {"inputs": "name", "target": None, "tokenizer": str(tmp_path / "nope")},
            "tokenizer folder",
        ),
    }
    for what, (args, needle) in cases.items():
        work = tmp_path / what.replace(" ", "-")
        argv = [sys.executable, "-m", "trainflow.flows.cli", "run", "--preset", "tiny"]
        for item in (
            f"workdir={work}",
            "preprocess.source=parquet",
            f"preprocess.source_args={json.dumps({**base, **args})}",
        ):
            argv += ["--set", item]
        out = subprocess.run(argv, capture_output=True, text=True, timeout=300)
        lines = [line for line in out.stderr.splitlines() if line.strip()]
        assert out.returncode != 0 and len(lines) == 1, (what, out.stderr[-2000:])
        assert needle in lines[0] and "source 'parquet'" in lines[0], (what, lines)
        assert not work.exists(), f"{what}: the run created {work} before refusing"
