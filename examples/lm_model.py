"""A small GPT-style byte-level language model (the model of examples/train_lm.py).

Bytes in, next-byte logits out: a token embedding (256 entries), a learned
position embedding, ``n_layers`` pre-norm transformer blocks (causal
self-attention, GELU MLP) and an untied output head. Nothing in it knows about
distribution; ``train_lm.parallelize`` shards or replicates it.
"""

from __future__ import annotations

from dataclasses import dataclass

import tensorplay as tp
import tensorplay.nn as nn
import tensorplay.nn.functional as F
from tensorplay.utils.checkpoint import checkpoint

VOCAB = 256  # bytes


@dataclass(frozen=True)
class LMConfig:
    dim: int = 256
    n_layers: int = 4
    n_heads: int = 8
    max_seq_len: int = 256
    mlp_ratio: int = 4


class Attention(nn.Module):
    def __init__(self, cfg: LMConfig) -> None:
        super().__init__()
        self.n_heads = cfg.n_heads
        self.qkv = nn.Linear(cfg.dim, 3 * cfg.dim, bias=False)
        self.proj = nn.Linear(cfg.dim, cfg.dim, bias=False)

    def forward(self, x: tp.Tensor) -> tp.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.n_heads, d // self.n_heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, d))


class MLP(nn.Module):
    def __init__(self, cfg: LMConfig) -> None:
        super().__init__()
        self.up = nn.Linear(cfg.dim, cfg.mlp_ratio * cfg.dim)
        self.down = nn.Linear(cfg.mlp_ratio * cfg.dim, cfg.dim)

    def forward(self, x: tp.Tensor) -> tp.Tensor:
        return self.down(F.gelu(self.up(x)))


class Block(nn.Module):
    def __init__(self, cfg: LMConfig) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(cfg.dim)
        self.attn = Attention(cfg)
        self.norm2 = nn.LayerNorm(cfg.dim)
        self.mlp = MLP(cfg)

    def forward(self, x: tp.Tensor) -> tp.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class ByteLM(nn.Module):
    def __init__(self, cfg: LMConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok = nn.Embedding(VOCAB, cfg.dim)
        self.pos = nn.Embedding(cfg.max_seq_len, cfg.dim)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.norm = nn.LayerNorm(cfg.dim)
        self.head = nn.Linear(cfg.dim, VOCAB, bias=False)
        #: Recompute each block's activations in backward instead of keeping them (set by ``--ac``).
        self.checkpoint_blocks = False
        for name, p in self.named_parameters():
            if p.dim() == 2:
                nn.init.normal_(p, std=0.02 / (2 * cfg.n_layers) ** 0.5 if name.endswith(("proj.weight", "down.weight"))
                                else 0.02)

    def forward(self, idx: tp.Tensor) -> tp.Tensor:
        x = self.tok(idx) + self.pos(tp.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = checkpoint(block, x, use_reentrant=False) if self.checkpoint_blocks else block(x)
        return self.head(self.norm(x))


def num_params(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


@tp.no_grad()
def generate(model: ByteLM, prompt: bytes, new_bytes: int, *, temperature: float = 0.8, seed: int = 0) -> bytes:
    """Sample ``new_bytes`` bytes after ``prompt`` from an unsharded model (no KV cache: it is short)."""
    device = next(model.parameters()).device
    generator = tp.Generator(device=device).manual_seed(seed)
    idx = tp.tensor([list(prompt)], dtype=tp.long, device=device)
    for _ in range(new_bytes):
        logits = model(idx[:, -model.cfg.max_seq_len:])[:, -1].float() / temperature
        nxt = tp.multinomial(F.softmax(logits, dim=-1), 1, generator=generator)
        idx = tp.cat([idx, nxt], dim=1)
    return bytes(idx[0, len(prompt):].tolist())
