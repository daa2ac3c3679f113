"""Make what the fine-tuning example starts from, offline, in this folder:

- data/docstrings.parquet: one column `text`, the docstrings of the Python standard library's
  modules N to Z (real English prose written by many people; on every machine with Python),
  in row groups of 200 documents;
- tokenizer/: a byte-level BPE tokenizer trained on that text (a `transformers` fast-tokenizer
  folder: tokenizer.json, tokenizer_config.json);
- base-model/: a small GPT-2 pretrained for a hundred steps on the docstrings of modules
  A to M, written with `save_pretrained` (config.json, model.safetensors) beside its tokenizer:
  the model the example fine-tunes.

`python prepare.py` (under a minute on 2 idle CPU cores); `--force` makes them again.
"""

import argparse
import ast
import sysconfig
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import GPT2Config, GPT2LMHeadModel, PreTrainedTokenizerFast

HERE = Path(__file__).resolve().parent
EOS = "<|endoftext|>"
VOCAB = 1024
CONTEXT = 64


def docstrings(first: str, last: str) -> list[str]:
    """Docstrings (modules, classes, functions) of the stdlib's top-level modules whose names
    start with a letter from `first` to `last`, in file-name order."""
    folder = Path(sysconfig.get_paths()["stdlib"])
    found = []
    for path in sorted(folder.glob("*.py")):
        if not first <= path.name[0].lower() <= last:
            continue
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError):
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef):
                text = ast.get_docstring(node)
                if text and len(text) >= 80:
                    found.append(text)
    return found


def write_parquet(texts: list[str], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.table({"text": texts}), path, row_group_size=200)


def train_tokenizer(texts: list[str], folder: Path) -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB,
        special_tokens=[EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(texts, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS, bos_token=EOS)
    fast.save_pretrained(folder)
    return fast


def pretrain(
    texts: list[str], tokenizer: PreTrainedTokenizerFast, folder: Path, steps: int
) -> None:
    """A small GPT-2 trained for `steps` steps on `texts`, saved with its tokenizer."""
    torch.manual_seed(0)
    ids: list[int] = []
    for text in texts:
        ids += tokenizer(text)["input_ids"] + [tokenizer.eos_token_id]
    n = (len(ids) - 1) // CONTEXT
    data = torch.tensor(ids[: n * CONTEXT + 1])
    x = data[:-1].view(n, CONTEXT)
    y = data[1:].view(n, CONTEXT)
    config = GPT2Config(
        vocab_size=len(tokenizer),
        n_positions=CONTEXT,
        n_embd=64,
        n_layer=2,
        n_head=4,
        bos_token_id=tokenizer.eos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        use_cache=False,
    )
    model = GPT2LMHeadModel(config)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    start = time.monotonic()
    for step in range(steps):
        batch = torch.randint(0, n, (16,))
        loss = torch.nn.functional.cross_entropy(
            model(x[batch]).logits.flatten(0, 1), y[batch].flatten()
        )
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step % 40 == 39:
            print(f"pretraining step {step + 1}: loss {loss.item():.3f}", flush=True)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    print(f"base model: {folder} ({time.monotonic() - start:.0f} s of pretraining)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--force", action="store_true", help="make everything again")
    parser.add_argument("--steps", type=int, default=120, help="pretraining steps of the base")
    args = parser.parse_args()
    data, tok_dir, base = (
        HERE / "data" / "docstrings.parquet",
        HERE / "tokenizer",
        HERE / "base-model",
    )
    if not args.force and data.exists() and tok_dir.is_dir() and base.is_dir():
        print(f"{data}, {tok_dir} and {base} exist (--force makes them again)")
        return
    finetune = docstrings("n", "z")
    write_parquet(finetune, data)
    print(f"data: {data} ({len(finetune)} docstrings)")
    tokenizer = train_tokenizer(finetune + docstrings("a", "m"), tok_dir)
    print(f"tokenizer: {tok_dir} ({len(tokenizer)} tokens)")
    pretrain(docstrings("a", "m"), tokenizer, base, args.steps)


if __name__ == "__main__":
    main()
