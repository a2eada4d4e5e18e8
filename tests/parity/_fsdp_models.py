"""Tiny models and data shared by the fully_shard parity tests.

Sizes are chosen so that dim 0 of most parameters is not a multiple of 2 or 4
(padding is exercised) and one parameter has fewer rows than some ranks
(``pos``: 6 rows over 4 ranks leaves the last rank an empty shard).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

import tensorplay as tp
import tensorplay.nn as nn

VOCAB = 13
DIM = 10
HEADS = 2
SEQ = 6
BATCH = 2


class Block(nn.Module):
    """Pre-norm causal self-attention + MLP."""

    def __init__(self, dim: int = DIM, heads: int = HEADS) -> None:
        super().__init__()
        self.heads = heads
        self.norm1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)  # a key bias has a zero gradient: Adam would amplify noise
        self.proj = nn.Linear(dim, dim)
        self.norm2 = nn.LayerNorm(dim)
        self.fc1 = nn.Linear(dim, 3 * dim)
        self.fc2 = nn.Linear(3 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).chunk(3, dim=-1)
        q, k, v = (y.reshape(b, t, self.heads, d // self.heads).transpose(1, 2) for y in (q, k, v))
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(att.transpose(1, 2).reshape(b, t, d))
        return x + self.fc2(F.gelu(self.fc1(self.norm2(x))))


class TinyTransformer(nn.Module):
    """Embedding + learned positions + blocks + norm + head; ``tie=True`` shares embedding and head."""

    def __init__(self, n_blocks: int = 3, tie: bool = False) -> None:
        super().__init__()
        self.tok = nn.Embedding(VOCAB, DIM)
        self.pos = nn.Parameter(tp.randn(SEQ, DIM) * 0.1)
        self.register_buffer("out_scale", tp.tensor([1.5]))
        self.layers = nn.ModuleList(Block() for _ in range(n_blocks))
        self.norm = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)
        if tie:
            self.head.weight = self.tok.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.tok(tokens) + self.pos[: tokens.shape[1]]
        for layer in self.layers:
            x = layer(x)
        return self.head(self.norm(x)) * self.out_scale

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        """A method other than forward that reads the root's parameters."""
        return self.tok(tokens) + self.pos[: tokens.shape[1]]


class MLPBlock(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.fc1 = nn.Linear(dim, 3 * dim)
        self.fc2 = nn.Linear(3 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(tp.relu(self.fc1(self.norm(x))))


class TinyLM(nn.Module):
    """Embedding, pre-norm MLP blocks, head: odd sizes so dim-0 padding is exercised at 2 and 4 ranks."""

    def __init__(self, blocks: int = 2, tied: bool = False) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList(MLPBlock(DIM) for _ in range(blocks))
        self.head = nn.Linear(DIM, VOCAB, bias=not tied)
        if tied:
            self.head.weight = self.emb.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.emb(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def build(seed: int = 0, tie: bool = False, n_blocks: int = 3) -> TinyTransformer:
    tp.manual_seed(seed)
    return TinyTransformer(n_blocks=n_blocks, tie=tie)


def batch(step: int, part: int, micro: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Tokens and next-token targets for one data-parallel part of one (micro)step."""
    g = torch.Generator().manual_seed(10007 * step + 101 * part + micro)
    seq = tp.randint(0, VOCAB, (BATCH, SEQ + 1), generator=g)
    return seq[:, :-1], seq[:, 1:]


def parts_batch(step: int, parts: list[int], micro: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """The concatenation of several parts' batches (a larger rank's local batch, or the global one)."""
    xs, ys = zip(*(batch(step, p, micro) for p in parts), strict=True)
    return tp.cat(xs), tp.cat(ys)


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.float().reshape(-1, VOCAB), targets.reshape(-1))
