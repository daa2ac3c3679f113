"""The built-in table sources on a real dask cluster: Parquet files (a part per row group) and
Hugging Face datasets saved to disk (a part per row range), numeric columns as features and
targets, a text column tokenized on the workers by a real tokenizer from a folder and packed
into next-token windows; the tokenizer's identity in the dataset's key; bad input one line,
from the checks that run before any job (preflight's probe)."""

import os
from pathlib import Path

import distributed
import numpy as np
import pyarrow.parquet as pq
import pytest

from tests.tables import numeric_table, stdlib_documents, train_tokenizer, write_text_parquet
from trainflow.cluster.dask import Backend
from trainflow.errors import DataError
from trainflow.tasks.preprocess.config import PreprocessConfig
from trainflow.tasks.preprocess.dataset import load_raw_split
from trainflow.tasks.preprocess.preflight import probe_spec
from trainflow.tasks.preprocess.ref import DatasetRef, dataset_spec
from trainflow.tasks.preprocess.run import run_preprocess
from trainflow.tasks.preprocess.task import dataset_key

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
CONTEXT = 24


@pytest.fixture(scope="module")
def docs() -> list[str]:
    return stdlib_documents(count=40, max_chars=3000)


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory, docs: list[str]) -> Path:
    return train_tokenizer(tmp_path_factory.mktemp("tok") / "tokenizer", docs, vocab=300)


def _run(cfg: PreprocessConfig, out: Path, dask: tuple[distributed.Client, Backend]) -> DatasetRef:
    client, backend = dask
    return run_preprocess(cfg, out, client, backend, dataset_key(cfg))


def _text_cfg(source: str, path: Path, folder: Path, **extra: object) -> PreprocessConfig:
    args = {"path": str(path), "inputs": "text", "tokenizer": str(folder), "context": CONTEXT}
    return PreprocessConfig(source=source, source_args={**args, **extra}, shard_size=64)


def _windows(docs: list[str], tokenizer: Path, groups: list[list[str]]) -> np.ndarray:
    """The windows each group of documents packs into, computed here with transformers' own
    loader of the folder (not trainflow's): ids of each document, then eos, cut per group."""
    from transformers import PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast.from_pretrained(str(tokenizer))
    eos = tok.convert_tokens_to_ids("<eos>")
    windows = []
    for group in groups:
        flat = [i for d in group for i in [*tok(d, add_special_tokens=False)["input_ids"], eos]]
        n = (len(flat) - 1) // CONTEXT
        windows.append(np.asarray(flat[: n * CONTEXT + 1]))
    return np.concatenate([w[:-1].reshape(-1, CONTEXT) for w in windows])


def _all_rows(ref: DatasetRef) -> tuple[np.ndarray, np.ndarray]:
    parts = [load_raw_split(ref.path, split) for split in ("train", "val", "test")]
    return np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts])


@pytest.mark.services  # a dask cluster
def test_parquet_text_is_tokenized_on_the_workers_and_packed_into_windows(
    dask_cpu: tuple[distributed.Client, Backend],
    tmp_path: Path,
    docs: list[str],
    tokenizer: Path,
) -> None:
    file = write_text_parquet(tmp_path / "text.parquet", docs, rows_per_group=10)
    cfg = _text_cfg("parquet", file, tokenizer)
    ref = _run(cfg, tmp_path / "out", dask_cpu)
    assert ref.shape == (CONTEXT,) and ref.target_shape == (CONTEXT,)
    assert ref.num_classes == 300 and ref.normalisation == "none"  # the tokenizer's vocabulary
    x, y = _all_rows(ref)
    assert x.dtype == np.int64 and y.dtype == np.int64
    np.testing.assert_array_equal(x[:, 1:], y[:, :-1])  # targets: the next token
    expected = _windows(docs, tokenizer, [docs[i : i + 10] for i in range(0, len(docs), 10)])
    assert len(x) == len(expected)  # every row group's full windows, each once
    assert {w.tobytes() for w in x} == {w.tobytes() for w in expected}
    spec = dataset_spec(ref, "sequence")
    assert spec == probe_spec(cfg, "sequence")  # preflight's first-part view agrees
    assert spec.output_shape(2) == (2, CONTEXT, 300)


@pytest.mark.services  # a dask cluster
def test_numeric_parquet_reads_only_the_named_columns(
    dask_cpu: tuple[distributed.Client, Backend], tmp_path: Path
) -> None:
    file = tmp_path / "num.parquet"
    pq.write_table(numeric_table(600), file, row_group_size=100, compression="none")
    _spoil_column(file, "name")  # any read of it would fail: only the named columns are read
    args = {"path": str(file), "inputs": ["f0", "f1", "f2", "f3"], "target": "label"}
    cfg = PreprocessConfig(source="parquet", source_args=args, shard_size=64)
    ref = _run(cfg, tmp_path / "out", dask_cpu)
    assert sum(ref.counts.values()) == 600 and ref.shape == (4,) and ref.n_classes == 3
    assert ref.normalisation == "per_feature" and ref.target_dtype == "int64"
    x, y = _all_rows(ref)
    table = pq.read_table(file, columns=["f0", "f1", "f2", "f3", "label"])
    original = np.stack([table.column(c).to_numpy() for c in ("f0", "f1", "f2", "f3")], 1)
    by_row = {
        r.tobytes(): int(label)
        for r, label in zip(
            original.astype(np.float32), table.column("label").to_numpy(), strict=True
        )
    }
    assert {r.tobytes(): int(label) for r, label in zip(x, y, strict=True)} == by_row
    with pytest.raises(OSError):
        pq.read_table(file, columns=["name"])  # the spoiled column really is unreadable
    regression = {**args, "target": "value"}
    reg = _run(
        PreprocessConfig(source="parquet", source_args=regression), tmp_path / "o2", dask_cpu
    )
    assert reg.target_dtype == "float32" and reg.n_classes is None


def _spoil_column(file: Path, column: str) -> None:
    """Overwrite every chunk of `column` in the file with 0xFF bytes (its footer kept)."""
    meta = pq.ParquetFile(file).metadata
    index = meta.schema.to_arrow_schema().get_field_index(column)
    with file.open("r+b") as handle:
        for group in range(meta.num_row_groups):
            chunk = meta.row_group(group).column(index)
            start = chunk.dictionary_page_offset or chunk.data_page_offset
            handle.seek(start)
            handle.write(b"\xff" * chunk.total_compressed_size)


@pytest.mark.services  # a dask cluster
def test_a_saved_dataset_is_read_in_row_ranges_of_its_split(
    dask_cpu: tuple[distributed.Client, Backend], tmp_path: Path, docs: list[str], tokenizer: Path
) -> None:
    import datasets

    table = numeric_table(500)
    vectors = np.stack([table.column(f"f{i}").to_numpy() for i in range(6)], 1)
    train = datasets.Dataset.from_dict({"v": vectors.tolist(), "y": table.column("value")})
    text = datasets.Dataset.from_dict({"text": docs})
    folder = tmp_path / "saved"
    datasets.DatasetDict({"train": train, "text": text}).save_to_disk(
        str(folder), num_shards={"train": 2, "text": 1}
    )
    args = {
        "path": str(folder),
        "inputs": "v",
        "target": "y",
        "split": "train",
        "rows_per_part": 128,
    }
    cfg = PreprocessConfig(source="hf_dataset", source_args=args, shard_size=64)
    ref = _run(cfg, tmp_path / "out", dask_cpu)
    assert sum(ref.counts.values()) == 500 and ref.shape == (6,) and ref.target_dtype == "float32"
    x, y = _all_rows(ref)
    np.testing.assert_allclose(y, x[:, 0] + 2 * x[:, 1], rtol=1e-4, atol=1e-4)  # rows paired
    lm = _text_cfg("hf_dataset", folder, tokenizer, split="text", rows_per_part=10)
    tokens = _run(lm, tmp_path / "lm", dask_cpu)
    x, _y = _all_rows(tokens)
    expected = _windows(docs, tokenizer, [docs[i : i + 10] for i in range(0, len(docs), 10)])
    assert {w.tobytes() for w in x} == {w.tobytes() for w in expected}
    with pytest.raises(
        DataError, match=r"splits \['text', 'train'\]: set preprocess\.source_args\.split"
    ):
        probe_spec(PreprocessConfig(source="hf_dataset", source_args={**args, "split": None}))


@pytest.mark.services  # a dask cluster
def test_the_tokenizer_is_part_of_the_datasets_identity(
    dask_cpu: tuple[distributed.Client, Backend],
    tmp_path: Path,
    docs: list[str],
) -> None:
    folder = train_tokenizer(tmp_path / "tok", docs, vocab=300)
    file = write_text_parquet(tmp_path / "text.parquet", docs, rows_per_group=20)
    cfg = _text_cfg("parquet", file, folder)
    key, ref = dataset_key(cfg), _run(cfg, tmp_path / "out", dask_cpu)
    assert dataset_key(cfg) == key  # stable while nothing changes
    train_tokenizer(folder, docs, vocab=260)  # the same folder and config, another tokenizer
    assert dataset_key(cfg) != key
    again = _run(cfg, tmp_path / "out", dask_cpu)
    assert again.content_hash != ref.content_hash and again.path != ref.path
    assert again.num_classes == 260


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            {"inputs": "txt"},
            r"no column 'txt' \(it has id, text\): fix preprocess\.source_args\.inputs",
        ),
        ({"inputs": "id"}, r"column 'id' is int64, not text: a tokenizer reads a string column"),
        (
            {"tokenizer": "/no/such/tokenizer"},
            r"tokenizer folder '/no/such/tokenizer' does not exist",
        ),
        ({"eos_token": "<end>"}, r"has no token '<end>': set preprocess\.source_args\.eos_token"),
        ({"context": 100000}, r"fewer than one window of source_args\.context=100000"),
    ],
)
def test_bad_text_input_is_one_line_before_any_job(
    tmp_path: Path, docs: list[str], tokenizer: Path, args: dict[str, object], message: str
) -> None:
    file = write_text_parquet(tmp_path / "text.parquet", docs[:12], rows_per_group=4)
    cfg = _text_cfg("parquet", file, tokenizer, **args)
    with pytest.raises(DataError, match=message) as err:
        probe_spec(cfg, "sequence")
    assert "\n" not in str(err.value) and "source 'parquet'" in str(err.value)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ({"target": "lable"}, r"no column 'lable' .*: fix preprocess\.source_args\.target"),
        (
            {"inputs": ["f0", "name"]},
            r"column .name. \(an input\) is string, not a number: to model text, give source_args",
        ),
        (
            {"target": "name"},
            r"column 'name' \(the target\) is string, not a number: store class labels as integers",
        ),
        ({"target": None}, r"no source_args\.target: name the target column"),
        ({"path": "/no/such.parquet"}, r"path '/no/such\.parquet' does not exist"),
    ],
)
def test_bad_numeric_input_is_one_line_before_any_job(
    tmp_path: Path, args: dict[str, object], message: str
) -> None:
    file = tmp_path / "num.parquet"
    pq.write_table(numeric_table(50), file)
    base = {"path": str(file), "inputs": ["f0", "f1"], "target": "label"}
    with pytest.raises(DataError, match=message) as err:
        probe_spec(PreprocessConfig(source="parquet", source_args={**base, **args}))
    assert "\n" not in str(err.value)
