"""fully_shard benchmark: ours vs PyTorch's fully_shard vs DDP, 2 ranks on Gloo (CPU).

A 6-block transformer (~27M parameters), per-block fully_shard plus the root,
Adam. Each implementation runs in fresh processes so peak RSS is its own.
Prints step time (median of the timed steps), peak RSS per rank, and the
parameter bytes each rank holds between steps. The sharded models are built on
the meta device and materialized shard by shard (as users do); DDP's is built
whole on the CPU, which counts in its peak RSS.

    .venv/bin/python bench/bench_fsdp.py [--steps 4] [--dim 512] [--blocks 6]
"""

from __future__ import annotations

import argparse
import resource
import statistics

import torch

import tensorplay as tp
import tensorplay.distributed as dist
from _timing import rank_step_timer  # bench/ is on sys.path when run as a script
from tensorplay import nn
from tensorplay.testing.distributed import run_distributed

VOCAB, SEQ, ROWS = 8192, 64, 2


class Block(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.fc1, self.fc2 = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)
        self.heads = max(dim // 64, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, s, 3, self.heads, d // self.heads).unbind(2)
        att = nn.functional.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                         is_causal=True)
        x = x + self.proj(att.transpose(1, 2).reshape(b, s, d))
        return x + self.fc2(nn.functional.gelu(self.fc1(self.norm2(x))))


class Transformer(nn.Module):
    def __init__(self, dim: int, blocks: int) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, dim)
        self.blocks = nn.ModuleList(Block(dim) for _ in range(blocks))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, VOCAB, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.emb(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def _init(model: nn.Module) -> None:
    """Deterministic init that works on plain tensors and DTensors alike (same values everywhere)."""
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.02) if p.dim() > 1 else p.fill_(1.0 if p.shape[0] else 0.0)


def _build(impl: str, dim: int, blocks: int) -> nn.Module:
    tp.manual_seed(0)
    if impl == "ddp":
        model = Transformer(dim, blocks)
        _init(model)
        return nn.parallel.DistributedDataParallel(model)
    if impl == "ours":
        from tensorplay.distributed.fsdp import fully_shard
    else:
        from torch.distributed.fsdp import fully_shard
    with torch.device("meta"):  # never materialize the whole model on one rank
        model = Transformer(dim, blocks)
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    model.to_empty(device="cpu")
    _init(model)
    return model


def _param_bytes(model: nn.Module) -> int:
    total = 0
    for p in model.parameters():
        local = p.to_local() if hasattr(p, "to_local") else p
        total += local.numel() * local.element_size()
    return total


def _peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def run(impl: str, dim: int, blocks: int, steps: int, warmup: int) -> dict[str, float]:
    torch.set_num_threads(1)
    model = _build(impl, dim, blocks)
    optim = tp.optim.Adam(model.parameters(), lr=1e-4)
    gen = torch.Generator().manual_seed(dist.get_rank())
    times: list[float] = []
    losses = []
    for step in range(warmup + steps):
        tokens = torch.randint(0, VOCAB, (ROWS, SEQ), generator=gen)
        with rank_step_timer(times if step >= warmup else None):
            logits = model(tokens)
            loss = nn.functional.cross_entropy(logits.flatten(0, 1), tokens.flatten())
            loss.backward()
            optim.step()
            optim.zero_grad()
        losses.append(loss.item())
    return {"step_ms": statistics.median(times), "peak_rss_mib": _peak_rss_mib(),
            "param_mib": _param_bytes(model) / 2**20, "last_loss": losses[-1],
            "total_params": sum(p.numel() for p in model.parameters())}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--dim", type=int, default=512)
    parser.add_argument("--blocks", type=int, default=6)
    args = parser.parse_args()
    results = {}
    for impl in ("ours", "torch", "ddp"):
        per_rank = run_distributed(run, impl, args.dim, args.blocks, args.steps, args.warmup, world_size=2,
                                   fresh=True, timeout=600)
        results[impl] = {key: max(r[key] for r in per_rank) for key in per_rank[0]}
    params = results["ddp"]["total_params"]
    print(f"\nfully_shard, 2 ranks, Gloo/CPU, {params / 1e6:.1f}M params, {args.blocks} blocks, dim {args.dim}, "
          f"{ROWS}x{SEQ} tokens per rank, median of {args.steps} steps (worst rank)\n")
    print("| impl | step ms | vs PyTorch fully_shard | peak RSS MiB/rank | param MiB/rank |")
    print("|---|---|---|---|---|")
    names = {"ours": "tensorplay fully_shard", "torch": "PyTorch fully_shard", "ddp": "PyTorch DDP"}
    for impl, r in results.items():
        ratio = r["step_ms"] / results["torch"]["step_ms"]
        print(f"| {names[impl]} | {r['step_ms']:.0f} | {ratio:.2f}x | {r['peak_rss_mib']:.0f} | {r['param_mib']:.1f} |")
    expected = params * 4 / 2 / 2**20
    print(f"\nsharded param bytes: total/world = {expected:.1f} MiB (+ dim-0 padding); "
          f"losses ours {results['ours']['last_loss']:.4f} torch {results['torch']['last_loss']:.4f}")


if __name__ == "__main__":
    main()
