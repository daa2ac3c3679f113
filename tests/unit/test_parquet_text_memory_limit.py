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

Training and evaluation read token windows from the same shards, through the same streaming
reader, as any dataset's: tests/unit/test_memory_limit.py proves the whole pipeline bounded on
splits each larger than the limit.
"""

import json
import os
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

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
