"""Tables, text and tokenizers written the way users write them (pyarrow, `datasets`'
save_to_disk, `tokenizers`), from data every machine has offline: the Python standard
library's own source files (real prose and code by many authors) and seeded numbers."""

import sysconfig
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq


def stdlib_documents(count: int = 60, max_chars: int = 4000) -> list[str]:
    """The first `count` top-level standard-library modules' text (sorted by name), each cut
    to `max_chars` characters: one document each."""
    folder = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in folder.glob("*.py") if p.stat().st_size > 2000)[:count]
    return [p.read_text(errors="replace")[:max_chars] for p in files]


def train_tokenizer(folder: Path, texts: list[str], vocab: int = 300, kind: str = "bpe") -> Path:
    """A byte-level BPE (or word-level) tokenizer trained on `texts`, saved as a fast
    tokenizer folder by transformers' save_pretrained (tokenizer.json + tokenizer_config.json
    naming "<eos>")."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from tokenizers.trainers import Trainer
    from transformers import PreTrainedTokenizerFast

    if kind == "bpe":
        tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
        tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tokenizer.decoder = decoders.ByteLevel()
        trainer: Trainer = trainers.BpeTrainer(
            vocab_size=vocab,
            special_tokens=["<unk>", "<eos>"],
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        )
    else:
        tokenizer = Tokenizer(models.WordLevel(unk_token="<unk>"))
        tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
        trainer = trainers.WordLevelTrainer(vocab_size=vocab, special_tokens=["<unk>", "<eos>"])
    tokenizer.train_from_iterator(texts, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<eos>", unk_token="<unk>")
    fast.save_pretrained(str(folder))
    return folder


def write_text_parquet(file: Path, texts: list[str], rows_per_group: int = 10) -> Path:
    """A Parquet file with a `text` column (the documents), an `id` column (never read) and
    row groups of `rows_per_group` documents."""
    file.parent.mkdir(parents=True, exist_ok=True)
    table = pa.table({"id": np.arange(len(texts)), "text": texts})
    pq.write_table(table, file, row_group_size=rows_per_group)
    return file


def numeric_table(rows: int, features: int = 6, classes: int = 3, seed: int = 0) -> pa.Table:
    """Learnable classification: each class a centre in feature space, plus noise; columns
    f0..f{features-1} (float64), `label` (int64 class), `value` (float: a regression target,
    f0 + 2 f1) and `name` (a string)."""
    rng = np.random.default_rng(seed)
    centres = rng.normal(0.0, 3.0, (classes, features))
    labels = rng.integers(0, classes, rows)
    x = centres[labels] + rng.normal(0.0, 1.0, (rows, features))
    columns: dict[str, object] = {f"f{i}": x[:, i] for i in range(features)}
    columns["label"] = labels
    columns["value"] = x[:, 0] + 2 * x[:, 1]
    columns["name"] = [f"row{i}" for i in range(rows)]
    return pa.table(columns)
