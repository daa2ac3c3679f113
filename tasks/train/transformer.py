"""The built-in decoder transformer (`train.model=transformer`): a small Llama-style causal
language model over token ids, with its tensor-parallel plan.

Token embedding -> `layers` blocks (RMSNorm -> causal multi-head attention with rotary
positions -> residual; RMSNorm -> SwiGLU MLP -> residual) -> RMSNorm -> output layer: the
next-token logits at every position (batch, T, vocabulary). No dropout, no tied weights, no
position table: the same function under any split of its layers.

Its plan (`tp_plan`, tasks.train.parallel.tensor_parallel) is torchtitan's Llama plan: the
embedding splits the vocabulary and leaves each rank its part of the sequence (sequence
parallelism); each norm runs on that part; attention and MLP gather the sequence, split their
heads / hidden units column-wise and reduce-scatter back to parts of the sequence row-wise;
the output layer splits the vocabulary and gathers the logits whole.
"""

from fnmatch import fnmatchcase

import torch
import torch.nn.functional as F
from torch import nn

from trainflow.errors import ConfigError
from trainflow.tasks.spec import DataSpec


def rotary(x: torch.Tensor) -> torch.Tensor:
    """`x` (batch, heads, T, head_dim) with rotary position embeddings: each pair of channels
    (i, i + head_dim/2) rotated by position x 10000^(-2i/head_dim)."""
    t, d = x.shape[-2], x.shape[-1]
    half = d // 2
    freqs = 10000.0 ** (-torch.arange(half, device=x.device, dtype=torch.float32) / half)
    angles = torch.arange(t, device=x.device, dtype=torch.float32)[:, None] * freqs
    cos, sin = angles.cos().to(x.dtype), angles.sin().to(x.dtype)
    first, second = x[..., :half], x[..., half:]
    return torch.cat((first * cos - second * sin, first * sin + second * cos), dim=-1)


class Attention(nn.Module):
    """Causal multi-head self-attention; the head count follows the width of wq's output, so
    a rank holding some of the heads (tensor parallelism) computes those."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.head_dim = dim // heads
        self.wq = nn.Linear(dim, dim, bias=False)
        self.wk = nn.Linear(dim, dim, bias=False)
        self.wv = nn.Linear(dim, dim, bias=False)
        self.wo = nn.Linear(dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(batch, T, dim) -> (batch, T, dim)."""
        b, t, _ = x.shape
        q, k, v = (w(x).view(b, t, -1, self.head_dim).transpose(1, 2) for w in self._qkv())
        out = F.scaled_dot_product_attention(rotary(q), rotary(k), v, is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(b, t, -1))

    def _qkv(self) -> tuple[nn.Linear, nn.Linear, nn.Linear]:
        return self.wq, self.wk, self.wv


class FeedForward(nn.Module):
    """SwiGLU: w2(silu(w1 x) * w3 x)."""

    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(batch, T, dim) -> (batch, T, dim)."""
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    """Pre-norm attention and MLP, each with a residual connection."""

    def __init__(self, dim: int, heads: int, hidden: int) -> None:
        super().__init__()
        self.attention_norm = nn.RMSNorm(dim)
        self.attention = Attention(dim, heads)
        self.ffn_norm = nn.RMSNorm(dim)
        self.feed_forward = FeedForward(dim, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(batch, T, dim) -> (batch, T, dim)."""
        x = x + self.attention(self.attention_norm(x))
        return x + self.feed_forward(self.ffn_norm(x))


class Transformer(nn.Module):
    """The decoder: embedding, blocks, final norm, output layer."""

    def __init__(self, vocab: int, dim: int, layers: int, heads: int, hidden: int) -> None:
        super().__init__()
        self.heads, self.hidden = heads, hidden
        self.tok_embeddings = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(Block(dim, heads, hidden) for _ in range(layers))
        self.norm = nn.RMSNorm(dim)
        self.output = nn.Linear(dim, vocab, bias=False)
        nn.init.normal_(self.tok_embeddings.weight, std=0.02)  # GPT-2's: a uniform first guess

    def shard_units(self) -> list[nn.Module]:
        """The blocks: train.strategy=fsdp shards each on its own."""
        return list(self.layers)

    def tp_plan(self, tp: int) -> dict[str, object]:
        """The layers' split over `tp` ranks (tasks.train.parallel.tensor_parallel);
        ConfigError when the heads, the MLP's hidden units or the vocabulary do not divide."""
        return llama_plan(self.heads, self.hidden, self.output.out_features, tp)

    def pp_split(self, stage: int, stages: int) -> nn.Module:
        """Stage `stage` of `stages` (tasks.train.parallel.pipeline): an equal share of the
        blocks in order, the first stage with the embedding, the last with the final norm
        and the output layer, each under its name here; ConfigError when the blocks do not
        divide."""
        n = len(self.layers)
        if n % stages:
            raise ConfigError(
                f"train.parallel.pp={stages} does not divide the transformer's {n} layers: set "
                f"train.parallel.pp to a divisor of {n}, or train.model_args.layers"
            )
        per = n // stages
        return TransformerStage(self, range(stage * per, (stage + 1) * per), stage, stages)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """(batch, T) token ids -> (batch, T, vocabulary) logits."""
        x = self.tok_embeddings(ids)
        for layer in self.layers:
            x = layer(x)
        return self.output(self.norm(x))


class TransformerStage(nn.Module):
    """One pipeline stage of a Transformer: its blocks `owned` (a ModuleDict keyed by their
    index in the whole model, so `layers.3.attention.wq.weight` keeps its name), with the
    embedding on the first stage and the final norm and output layer on the last."""

    def __init__(self, model: Transformer, owned: range, stage: int, stages: int) -> None:
        super().__init__()
        first, last = stage == 0, stage == stages - 1
        self.tok_embeddings = model.tok_embeddings if first else None
        self.layers = nn.ModuleDict({str(i): model.layers[i] for i in owned})
        self.norm = model.norm if last else None
        self.output = model.output if last else None
        self.sizes = (model.heads, model.hidden, model.output.out_features)

    def tp_plan(self, tp: int) -> dict[str, object]:
        """The whole model's plan for the modules this stage holds (pipeline stages with
        tensor parallelism: each stage splits its own layers over its tp group)."""
        names = [name for name, _ in self.named_modules()]
        plan = llama_plan(*self.sizes, tp)
        return {k: v for k, v in plan.items() if any(fnmatchcase(n, k) for n in names)}

    def shard_units(self) -> list[nn.Module]:
        """The stage's blocks: train.strategy=fsdp shards each on its own."""
        return list(self.layers.values())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Token ids (first stage) or the previous stage's activations (batch, T, dim) ->
        activations, or the logits on the last stage."""
        if self.tok_embeddings is not None:
            x = self.tok_embeddings(x)
        for layer in self.layers.values():
            x = layer(x)
        if self.norm is not None and self.output is not None:
            x = self.output(self.norm(x))
        return x


def llama_plan(heads: int, hidden: int, vocabulary: int, tp: int) -> dict[str, object]:
    """torchtitan's Llama plan over `tp` ranks, with sequence parallelism (module docstring);
    ConfigError when `tp` does not divide the heads, the MLP's hidden units or the vocabulary."""
    sizes = {"heads": heads, "hidden": hidden, "vocabulary": vocabulary}
    bad = {k: v for k, v in sizes.items() if v % tp}
    if bad:
        name, value = next(iter(bad.items()))
        arg = {"heads": "heads", "hidden": "hidden", "vocabulary": "(the dataset's)"}[name]
        raise ConfigError(
            f"train.parallel.tp={tp} does not divide the transformer's {value} {name}: "
            f"set train.parallel.tp to a divisor of {value}"
            + ("" if name == "vocabulary" else f", or train.model_args.{arg}")
        )
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
    )

    def gather() -> PrepareModuleInput:
        return PrepareModuleInput(
            input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),), use_local_output=True
        )

    return {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        "layers.*.attention_norm": SequenceParallel(),
        "layers.*.attention": gather(),
        "layers.*.attention.w[qkv]": ColwiseParallel(),
        "layers.*.attention.wo": RowwiseParallel(output_layouts=Shard(1)),
        "layers.*.ffn_norm": SequenceParallel(),
        "layers.*.feed_forward": gather(),
        "layers.*.feed_forward.w[13]": ColwiseParallel(),
        "layers.*.feed_forward.w2": RowwiseParallel(output_layouts=Shard(1)),
        "norm": SequenceParallel(),
        "output": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate()),
    }


def transformer(
    spec: DataSpec, dim: int = 64, layers: int = 2, heads: int = 4, hidden: int | None = None
) -> nn.Module:
    """Factory of the built-in `transformer`: next-token logits per position for token ids
    (objective sequence). `hidden`: the MLP's width, 4 x dim unless set."""
    if spec.num_classes is None or spec.sample_dtype != "int64" or len(spec.sample_shape) != 1:
        raise ConfigError(
            f"train.model=transformer reads sequences of token ids, but the data are "
            f"{spec.sample_dtype} samples shaped {spec.sample_shape}: use train.model=mlp or a "
            "model of your own"
        )
    if dim % heads or (dim // heads) % 2:
        raise ConfigError(
            f"train.model_args: dim={dim} must be heads={heads} x an even head size: change "
            "train.model_args.dim or heads"
        )
    return Transformer(int(spec.num_classes), dim, layers, heads, hidden or 4 * dim)
