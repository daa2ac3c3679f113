"""A user's model for the character language-model example: a small causal transformer.

trainflow calls `build(spec, **train.model_args)`: `spec.sample_shape` is (T,) token ids,
`spec.num_classes` the vocabulary size, and the output must be (batch, T, vocabulary): the
logits of the next character at every position.
"""

import torch
from torch import Tensor, nn

from trainflow.tasks.spec import DataSpec


class Block(nn.Module):
    """Pre-norm self-attention (causal) and MLP, each with a residual connection."""

    def __init__(self, dim: int, heads: int, dropout: float) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.attn = nn.MultiheadAttention(dim, heads, dropout=dropout, batch_first=True)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(
            nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim), nn.Dropout(dropout)
        )

    def forward(self, x: Tensor, mask: Tensor) -> Tensor:
        h = self.norm1(x)
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        return x + self.mlp(self.norm2(x))


class CharTransformer(nn.Module):
    """Token and position embeddings, `layers` blocks, a final norm and a tied output layer."""

    def __init__(
        self, vocab: int, context: int, dim: int, layers: int, heads: int, dropout: float
    ) -> None:
        super().__init__()
        self.tokens = nn.Embedding(vocab, dim)
        self.positions = nn.Embedding(context, dim)
        self.blocks = nn.ModuleList(Block(dim, heads, dropout) for _ in range(layers))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.tokens.weight  # tied: fewer parameters, better on small data
        # Small embeddings (GPT-2's 0.02): with N(0, 1) the tied output layer starts with
        # logits of size ~sqrt(dim), a loss far above the uniform guess's log(vocabulary).
        nn.init.normal_(self.tokens.weight, std=0.02)
        nn.init.normal_(self.positions.weight, std=0.02)
        self.mask: Tensor
        mask = torch.triu(torch.full((context, context), float("-inf")), diagonal=1)
        self.register_buffer("mask", mask, persistent=False)

    def shard_units(self) -> list[nn.Module]:
        """The transformer blocks: what trainflow's train.strategy=fsdp shards one by one (the
        tied embedding/output weight stays with the root: one parameter, one group)."""
        return list(self.blocks)

    def forward(self, ids: Tensor) -> Tensor:
        t = ids.shape[1]
        x = self.tokens(ids) + self.positions(torch.arange(t, device=ids.device))
        mask = self.mask[:t, :t]
        for block in self.blocks:
            x = block(x, mask)
        return self.head(self.norm(x))


def build(
    spec: DataSpec, dim: int = 128, layers: int = 2, heads: int = 4, dropout: float = 0.1
) -> nn.Module:
    """The model for `spec` (a trainflow DataSpec): vocabulary and context from the data."""
    (context,) = spec.sample_shape
    if spec.num_classes is None:
        raise ValueError("the char transformer needs token data with a vocabulary")
    return CharTransformer(spec.num_classes, context, dim, layers, heads, dropout)
