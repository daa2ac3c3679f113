"""A Parquet TEXT dataset whose token windows outweigh a memory cgroup's limit preprocesses
inside it: the windows' targets (the inputs shifted by one token, as large as they are) stay on
the dask worker, staged beside the inputs, and never reach the stage's own process.

cgroup v1 (needs root): the stage's process (the client, with the dask scheduler) and its one
dask worker run in a new group limited to LIMIT (memory and memory+swap);
memory.max_usage_in_bytes (page cache included) proves it held. The text is the standard
library's own source, tokenized on the worker by a word-level tokenizer trained here, packed
into windows of CONTEXT tokens: inputs and targets of 8 bytes a token, each about LIMIT in
all. Every row group holds the same documents, so the windows a row group gives (tokenized
independently, by `transformers`) are what every shard row must be.

The second test runs the whole pipeline (`trainflow run`: preprocess, token_conv trained and
evaluated on the `debug` executor in the flow process) on text whose windows outweigh the
whole pipeline's floor, PIPELINE_LIMIT, inside a group so limited. It takes minutes (4.4 min
here beside other tests; 8 min under a heavier load): under the limit the shards come back
from disk, not from the page cache.
"""

import json
import os
import shutil
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from mlflow.tracking import MlflowClient

from tests.cgroups import run_in_group
from tests.tables import stdlib_documents, train_tokenizer

ROOT = Path(__file__).resolve().parents[2]
LIMIT = 384 << 20
"""As the numeric Parquet test's limit: the stage's process with the scheduler ~190 MiB, the
worker ~150 MiB while it tokenizes a row group."""
CONTEXT = 256
DOCS_PER_GROUP = 120  # ~250k tokens a row group: the tokenizer's per-token objects stay small
TOKEN_BYTES = LIMIT  # the inputs alone; the targets as much again
SCRIPT = """
import json, sys
from pathlib import Path
from trainflow.cluster.config import DaskConfig
from trainflow.cluster.dask import dask_client
from trainflow.tasks.preprocess.config import PreprocessConfig
from trainflow.tasks.preprocess.run import run_preprocess
from trainflow.tasks.preprocess.sources import fingerprint

args = {"path": sys.argv[1], "inputs": "text", "tokenizer": sys.argv[3], "context": CONTEXT}
cfg = PreprocessConfig(source="parquet", source_args=args, shard_size=4096)
dask = DaskConfig(backend="cpu", n_workers=1, local_workers="processes")
with dask_client(dask) as (client, backend):
    ref = run_preprocess(cfg, Path(sys.argv[2]), client, backend, fingerprint(cfg))
print(json.dumps({"counts": ref.counts, "path": str(ref.path)}))
""".replace("CONTEXT", str(CONTEXT))


def _group_windows(docs: list[str], tokenizer: Path) -> tuple[np.ndarray, np.ndarray]:
    """(inputs, targets) windows of one row group, by transformers' tokenizer: each document's
    ids then the end-of-text id, cut into CONTEXT-token windows, targets shifted by one."""
    from transformers import PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast.from_pretrained(str(tokenizer))
    ids = [
        i for d in docs for i in [*tok(d, add_special_tokens=False)["input_ids"], tok.eos_token_id]
    ]
    n = (len(ids) - 1) // CONTEXT
    flat = np.asarray(ids, np.int64)
    return flat[: n * CONTEXT].reshape(n, CONTEXT), flat[1 : n * CONTEXT + 1].reshape(n, CONTEXT)


def _write_parquet(file: Path, docs: list[str], groups: int) -> None:
    """`groups` row groups of the same documents, in a `text` column beside an unread one."""
    table = pa.table({"id": np.arange(len(docs)), "text": docs})
    with pq.ParquetWriter(file, table.schema, compression="none") as writer:
        for _ in range(groups):
            writer.write_table(table, row_group_size=len(docs))


@pytest.mark.services  # a process with a dask cluster, ~1.5 GB of disk written
def test_parquet_text_larger_than_the_memory_limit_preprocesses_inside_it(
    memory_groups: Callable[[int], Path], tmp_path: Path
) -> None:
    limited_group = memory_groups(LIMIT)
    docs = stdlib_documents(DOCS_PER_GROUP, 20000)
    tokenizer = train_tokenizer(tmp_path / "tok", docs, vocab=2000, kind="word")
    x, y = _group_windows(docs, tokenizer)
    groups = -(-TOKEN_BYTES // x.nbytes)
    data = tmp_path / "text.parquet"
    _write_parquet(data, docs, groups)
    argv = [sys.executable, "-c", SCRIPT, str(data), str(tmp_path / "out"), str(tokenizer)]
    try:
        limited = run_in_group(
            limited_group, argv, ROOT, {**os.environ, "PYTHONPATH": str(ROOT)}, 240
        )
        limited.assert_held(LIMIT)
        done, peak = limited.done, limited.peak
        result = json.loads(done.stdout.strip().splitlines()[-1])
        assert sum(result["counts"].values()) == groups * len(x)  # every window, in shards
        target_of = {row.tobytes(): target.tobytes() for row, target in zip(x, y, strict=True)}
        windows = 0
        for shard in sorted(Path(result["path"]).glob("*.x.npy")):
            xs = np.load(shard)
            ys = np.load(shard.with_name(shard.name.replace(".x.npy", ".y.npy")))
            assert xs.shape == ys.shape == (len(xs), CONTEXT)
            for row, target in zip(xs, ys, strict=True):  # each its own window's targets
                assert target_of[row.tobytes()] == target.tobytes()
            windows += len(xs)
        assert windows * CONTEXT * 8 >= LIMIT  # inputs alone at the limit, targets as much
        print(
            f"parquet text {data.stat().st_size >> 20} MiB ({windows} windows of {CONTEXT} "
            f"tokens: {2 * windows * CONTEXT * 8 >> 20} MiB of inputs and targets), limit "
            f"{LIMIT >> 20} MiB, group peak {peak >> 20} MiB (page cache included)"
        )
    finally:
        data.unlink(missing_ok=True)
        for folder in (tmp_path / "out").glob("*"):
            for file in folder.glob("*.npy"):
                file.unlink()


PIPELINE_LIMIT = 896 << 20
"""The whole pipeline's floor (tests/unit/test_memory_limit.py): the flow process with torch,
MLflow, Prefect, the scheduler and training on the `debug` executor, and the dask worker."""


def _pipeline_args(data: Path, tokenizer: Path, work: Path) -> list[str]:
    args = {"path": str(data), "inputs": "text", "tokenizer": str(tokenizer), "context": CONTEXT}
    sets = {
        "workdir": work,
        "preprocess.source": "parquet",
        "preprocess.source_args": json.dumps(args),
        "preprocess.shard_size": 4096,
        "preprocess.val_fraction": 0.45,
        "preprocess.test_fraction": 0.44,
        "train.model": "token_conv",
        "train.model_args": '{"dim": 16}',
        "train.objective": "sequence",
        "train.epochs": 1,
        "train.batch_size": 64,
        "train.device": "cpu",
        "train.precision": "fp32",
        "train.data_placement": "stream",
        "train.test_after_training": "false",
        "evaluate.batch_size": 64,
        "cluster.executor": "debug",
        "cluster.ranks_per_node": 1,
        "cluster.dask.backend": "cpu",
        "cluster.dask.n_workers": 1,
    }
    flags = [arg for key, value in sets.items() for arg in ("--set", f"{key}={value}")]
    return [sys.executable, "-m", "trainflow.flows.cli", "run", *flags]


@pytest.mark.services  # the whole pipeline in a process, ~1 GB of disk written
def test_a_language_model_trains_on_parquet_text_larger_than_the_memory_limit(
    memory_groups: Callable[[int], Path], tmp_path: Path, prefect_api: str
) -> None:
    docs = stdlib_documents(DOCS_PER_GROUP, 20000)
    tokenizer = train_tokenizer(tmp_path / "tok", docs, vocab=300, kind="word")
    x, _y = _group_windows(docs, tokenizer)
    groups = -(-PIPELINE_LIMIT // (2 * x.nbytes))  # inputs and targets together
    data = tmp_path / "text.parquet"
    _write_parquet(data, docs, groups)
    group = memory_groups(PIPELINE_LIMIT)
    env = {
        **os.environ,
        "PREFECT_API_URL": prefect_api,
        "PREFECT_HOME": str(tmp_path / "prefect-home"),
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
    }
    env.pop("MLFLOW_TRACKING_URI", None)
    try:
        argv = _pipeline_args(data, tokenizer, tmp_path / "work")
        limited = run_in_group(group, argv, ROOT, env, 600)
        limited.assert_held(PIPELINE_LIMIT)
        done, peak = limited.done, limited.peak
        (manifest,) = (tmp_path / "work" / "datasets").glob("*/manifest.json")
        written = json.loads(manifest.read_text())
        windows = sum(written["counts"].values())
        assert windows == groups * len(x)
        assert 2 * windows * CONTEXT * 8 > PIPELINE_LIMIT
        client = MlflowClient(f"sqlite:///{tmp_path / 'work' / 'mlflow.db'}")
        experiment = client.get_experiment_by_name("trainflow")
        assert experiment is not None
        runs = client.search_runs([experiment.experiment_id])
        stages = {r.data.tags.get("stage"): r for r in runs}
        assert {"preprocess", "train", "evaluate"} <= set(stages), sorted(map(str, stages))
        assert all(r.info.status == "FINISHED" for r in runs)
        perplexity = stages["evaluate"].data.metrics["test_perplexity"]
        assert perplexity < 100  # 300 ids: nothing learnt is ~300
        print(
            f"parquet text {data.stat().st_size >> 20} MiB, {2 * windows * CONTEXT * 8 >> 20} "
            f"MiB of windows, limit {PIPELINE_LIMIT >> 20} MiB, group peak {peak >> 20} MiB, "
            f"test perplexity {perplexity:.1f}; "
            + next((line for line in done.stdout.splitlines() if "stage seconds" in line), "")
        )
    finally:
        data.unlink(missing_ok=True)
        shutil.rmtree(tmp_path / "work" / "datasets", ignore_errors=True)
