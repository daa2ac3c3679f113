"""Text to token ids for the table sources: a tokenizer from a local folder, and packing.

The folder is what `tokenizers.Tokenizer.save` or a `transformers` fast tokenizer's
`save_pretrained` writes: a `tokenizer.json`, and (from `save_pretrained`) a
`tokenizer_config.json` naming the end-of-text token. It is loaded with `tokenizers` alone
(light to import on every dask worker; `transformers` saves its fast tokenizers in that format).

Packing for language modelling: a part's documents are tokenized, joined with the end-of-text id
after each, and cut into windows of `context` tokens; the target of a window is the same window
shifted by one token. A part's last tokens that do not fill a window are dropped: the windows of
a part depend on that part alone, so every worker cuts them the same way.
"""

import functools
import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from trainflow.errors import ConfigError, DataError
from trainflow.tasks.hashing import sha256_folder

if TYPE_CHECKING:
    import tokenizers

TOKENIZER_FILE = "tokenizer.json"
HF_EXTRA = "pip install 'trainflow[hf]'"


@dataclass(frozen=True)
class TokenizerInfo:
    """What the client knows of a tokenizer folder: enough to check it and name its content."""

    folder: str
    digest: str
    """sha256 of the folder's files (names and bytes): the tokenizer's identity."""
    eos_id: int
    vocab_size: int
    """Every id the tokenizer can produce (added tokens included): the model's output width."""


def tokenizer_info(folder: str, eos_token: str | None, where: str) -> TokenizerInfo:
    """Load and check the tokenizer in `folder`; DataError naming `where` (the source) and the
    fix when the folder, its tokenizer.json or its end-of-text token is missing."""
    path = Path(folder)
    if not path.is_dir():
        raise DataError(
            f"{where}: tokenizer folder {folder!r} does not exist: set "
            "preprocess.source_args.tokenizer to a folder holding tokenizer.json (what "
            "Tokenizer.save or a fast tokenizer's save_pretrained writes)"
        )
    tokenizer = load_tokenizer(folder, where)
    eos = eos_token or _configured_eos(path)
    eos_id = tokenizer.token_to_id(eos) if eos else None
    if eos_id is None:
        what = f"has no token {eos!r}" if eos else "names no end-of-text token"
        raise DataError(
            f"{where}: the tokenizer in {folder!r} {what}: set preprocess.source_args."
            "eos_token to one of its special tokens"
        )
    vocab = tokenizer.get_vocab_size(with_added_tokens=True)
    return TokenizerInfo(str(path.resolve()), sha256_folder(path), int(eos_id), int(vocab))


def load_tokenizer(folder: str, where: str) -> "tokenizers.Tokenizer":
    """The tokenizer of `folder` (cached per process: each worker loads it once)."""
    file = Path(folder) / TOKENIZER_FILE
    if not file.is_file():
        raise DataError(
            f"{where}: tokenizer folder {folder!r} has no {TOKENIZER_FILE}: save a fast "
            "tokenizer there (tokenizers' Tokenizer.save, or transformers' save_pretrained)"
        )
    try:
        return _load(str(file), file.stat().st_mtime_ns)
    except ImportError as exc:
        raise ConfigError(f"{where}: tokenizing text needs `tokenizers`: {HF_EXTRA}") from exc
    except Exception as exc:  # tokenizers raises a plain Exception for a malformed file
        raise DataError(f"{where}: cannot load {str(file)!r}: {exc}") from exc


@functools.lru_cache(maxsize=4)
def _load(file: str, _mtime: int) -> "tokenizers.Tokenizer":
    import tokenizers

    return tokenizers.Tokenizer.from_file(file)


def _configured_eos(folder: Path) -> str | None:
    """The eos_token of tokenizer_config.json (what save_pretrained writes), if any."""
    config = folder / "tokenizer_config.json"
    if not config.is_file():
        return None
    try:
        token = json.loads(config.read_text()).get("eos_token")
    except (OSError, ValueError, AttributeError):
        return None
    if isinstance(token, dict):  # an AddedToken as older transformers wrote it
        token = token.get("content")
    return token if isinstance(token, str) else None


def pack(texts: list[Any], info: TokenizerInfo, context: int) -> tuple[np.ndarray, np.ndarray]:
    """(windows (n, context) int64, the same windows shifted by one token) of the documents
    `texts`, each followed by the end-of-text id; DataError when they fill no window."""
    tokenizer = load_tokenizer(info.folder, f"the tokenizer {info.folder!r}")
    encoded = tokenizer.encode_batch_fast(texts, add_special_tokens=False)
    eos = np.array([info.eos_id], np.int64)
    flat = np.concatenate([a for e in encoded for a in (np.asarray(e.ids, np.int64), eos)])
    n = (len(flat) - 1) // context
    if n < 1:
        raise DataError(
            f"{len(flat)} tokens, fewer than one window of source_args.context="
            f"{context} + 1: lower context, or put more rows in each part"
        )
    x = flat[: n * context].reshape(n, context)
    y = flat[1 : n * context + 1].reshape(n, context)
    return x, y
