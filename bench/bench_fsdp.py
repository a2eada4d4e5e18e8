"""fully_shard benchmark: ours vs PyTorch's fully_shard (and DDP), Gloo (CPU), 2 and 4 ranks and HSDP 2x2.

MLP rows (issue 16's model: 8 x Linear(1024)+GELU, one fully_shard per Linear
plus the root, Adam, batch 32 per rank): ours and PyTorch's are built in the
same processes and their steps alternate (who goes first alternates too), so
load from other processes hits both alike; the ratio is the median of the
per-step ratios. At 2 ranks (1 thread each), at 4 ranks (oversubscribed on a
2-core machine: the ratio still holds side by side, absolute times do not)
and HSDP on a 2x2 mesh (replicate x shard). Peak RSS per rank is measured
alone, in fresh processes per implementation (``--fixed-heap``: with glibc's
mmap threshold fixed, see [Note: peak RSS with a fixed mmap threshold] in
``_timing.py``), with this rank's share of the host's memory at that peak
(the shared-memory slots counted once per host, see ``peak_memory_mib``).

Transformer rows: a 6-block transformer (~27M parameters), per-block fully_shard plus the root,
Adam. Each implementation runs in fresh processes so peak RSS is its own.
Prints step time (median of the timed steps), peak RSS per rank, and the
parameter bytes each rank holds between steps. The sharded models are built on
the meta device and materialized shard by shard (as users do); DDP's is built
whole on the CPU, which counts in its peak RSS.

    .venv/bin/python bench/bench_fsdp.py [--steps 4] [--dim 512] [--blocks 6] [--mlp-steps 10] [--only mlp]
        [--setup 2|4|HSDP ...] [--no-rss]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import tensorplay as tp
import tensorplay.distributed as dist
from _timing import add_heap_option, fixed_heap, peak_memory_mib, rank_step_timer  # bench/ is on sys.path
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
    return {"step_ms": statistics.median(times), "peak_rss_mib": peak_memory_mib()["peak"],
            "param_mib": _param_bytes(model) / 2**20, "last_loss": losses[-1],
            "total_params": sum(p.numel() for p in model.parameters())}


# ---- MLP rows: ours and PyTorch's interleaved in one run ---------------------------------------------
MLP_WIDTH, MLP_DEPTH, MLP_BATCH = 1024, 8, 32
MLP_SETUPS = {"2 ranks": (2, None), "4 ranks (oversubscribed)": (4, None), "HSDP 2x2 (oversubscribed)": (4, (2, 2))}


def _mlp() -> nn.Module:
    tp.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(MLP_DEPTH):
        layers += [nn.Linear(MLP_WIDTH, MLP_WIDTH), nn.GELU()]
    return nn.Sequential(*layers)


def _sharded_mlp(impl: str, hsdp: tuple[int, int] | None) -> nn.Module:
    from torch.distributed.device_mesh import init_device_mesh

    if impl == "ours":
        from tensorplay.distributed.fsdp import fully_shard
    else:
        from torch.distributed.fsdp import fully_shard
    mesh = init_device_mesh("cpu", hsdp, mesh_dim_names=("replicate", "shard")) if hsdp else None
    model = _mlp()
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


class _MlpTrainer:
    """One implementation's sharded MLP and Adam; ``step(samples)`` runs (and times) one training step."""

    def __init__(self, impl: str, hsdp: tuple[int, int] | None) -> None:
        self.model = _sharded_mlp(impl, hsdp)
        self.optim = tp.optim.Adam(self.model.parameters(), lr=1e-4)
        self.x = torch.randn(MLP_BATCH, MLP_WIDTH, generator=torch.Generator().manual_seed(dist.get_rank()))

    def step(self, samples: list[float] | None, cpu_samples: list[float] | None = None) -> None:
        with rank_step_timer(samples):
            cpu_start = time.process_time()
            self.model(self.x).pow(2).mean().backward()
            self.optim.step()
            self.optim.zero_grad()
            if cpu_samples is not None:
                cpu_samples.append((time.process_time() - cpu_start) * 1e3)


def mlp_side_by_side(hsdp: tuple[int, int] | None, steps: int, warmup: int) -> dict[str, list[float]]:
    """Ours and PyTorch's in these processes, steps alternated; this rank's step times (ms) per implementation."""
    torch.set_num_threads(1)
    trainers = {impl: _MlpTrainer(impl, hsdp) for impl in ("ours", "torch")}
    samples: dict[str, list[float]] = {impl: [] for impl in (*trainers, "ours_cpu", "torch_cpu")}
    for i in range(warmup + steps):
        order = list(trainers) if i % 2 else list(trainers)[::-1]
        for impl in order:
            timed = i >= warmup
            trainers[impl].step(samples[impl] if timed else None, samples[f"{impl}_cpu"] if timed else None)
    return samples


def _side_by_side_summary(ranks: list[dict[str, list[float]]]) -> dict[str, float]:
    """A step takes as long as its slowest rank; the ratio is the median of the per-step ratios.

    CPU time (this process's threads, Gloo's included) is summed over ranks: on an overloaded machine it is
    the work that competes for the cores, and it varies far less with other processes' load than wall time.
    """
    worst = {impl: [max(times) for times in zip(*(r[impl] for r in ranks), strict=True)] for impl in ("ours", "torch")}
    cpu = {impl: [sum(times) for times in zip(*(r[f"{impl}_cpu"] for r in ranks), strict=True)]
           for impl in ("ours", "torch")}
    ratios = [a / b for a, b in zip(worst["ours"], worst["torch"], strict=True)]
    cpu_ratios = [a / b for a, b in zip(cpu["ours"], cpu["torch"], strict=True)]
    return {"ours_ms": statistics.median(worst["ours"]), "torch_ms": statistics.median(worst["torch"]),
            "ratio": statistics.median(ratios), "ratio_min": min(ratios), "ratio_max": max(ratios),
            "ours_cpu_ms": statistics.median(cpu["ours"]), "torch_cpu_ms": statistics.median(cpu["torch"]),
            "cpu_ratio": statistics.median(cpu_ratios)}


def mlp_memory_alone(impl: str, hsdp: tuple[int, int] | None, steps: int) -> dict[str, float]:
    """Peak RSS and host share (MiB, see ``peak_memory_mib``) of this rank after ``steps`` steps of one
    implementation alone (fresh processes)."""
    torch.set_num_threads(1)
    trainer = _MlpTrainer(impl, hsdp)
    for _ in range(steps):
        trainer.step(None)
    return peak_memory_mib()


def mlp_rows(steps: int, warmup: int, setups: list[str] | None = None, memory: bool = True,
             fixed: bool = False) -> None:
    params = sum(p.numel() for p in _mlp().parameters())
    print(f"\nfully_shard, MLP {MLP_DEPTH} x Linear({MLP_WIDTH})+GELU ({params / 1e6:.1f}M params), Adam, batch "
          f"{MLP_BATCH} per rank, Gloo/CPU, 1 thread per rank; ours and PyTorch's interleaved in one run, "
          f"median of {steps} steps (a step's time is its slowest rank's); ratio = median of per-step ratios "
          f"[min-max]\n")
    print("| setup | ours ms | PyTorch ms | ours / PyTorch | CPU ms/step, all ranks: ours | PyTorch | ratio "
          "| peak RSS MiB/rank ours | PyTorch | ratio | host share at the peak, ours | ratio |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for name, (world, hsdp) in MLP_SETUPS.items():
        if setups and not any(name.startswith(s) for s in setups):
            continue
        ranks = run_distributed(mlp_side_by_side, hsdp, steps, warmup, world_size=world, fresh=True, timeout=900)
        worst = _side_by_side_summary(ranks)
        rss = {impl: {"peak": float("nan"), "share": float("nan")} for impl in ("ours", "torch")}
        if memory:
            for impl in rss:
                with fixed_heap(fixed):
                    ranks = run_distributed(mlp_memory_alone, impl, hsdp, warmup + 1, world_size=world, fresh=True,
                                            timeout=900)
                rss[impl] = {key: max(r[key] for r in ranks) for key in ("peak", "share")}
        ours, theirs = rss["ours"], rss["torch"]
        print(f"| {name} | {worst['ours_ms']:.0f} | {worst['torch_ms']:.0f} | {worst['ratio']:.2f}x "
              f"[{worst['ratio_min']:.2f}-{worst['ratio_max']:.2f}] | {worst['ours_cpu_ms']:.0f} "
              f"| {worst['torch_cpu_ms']:.0f} | {worst['cpu_ratio']:.2f}x | {ours['peak']:.0f} | {theirs['peak']:.0f} "
              f"| {ours['peak'] / theirs['peak']:.3f} | {ours['share']:.1f} | {ours['share'] / theirs['share']:.3f} |",
              flush=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--dim", type=int, default=512)
    parser.add_argument("--blocks", type=int, default=6)
    parser.add_argument("--mlp-steps", type=int, default=10)
    parser.add_argument("--only", choices=("mlp", "transformer"), default=None)
    parser.add_argument("--setup", action="append", choices=("2", "4", "HSDP"),
                        help="MLP rows to run (repeatable; default: all): 2 ranks, 4 ranks, HSDP 2x2")
    parser.add_argument("--no-rss", action="store_true", help="skip the peak-RSS runs of the MLP rows")
    add_heap_option(parser)
    args = parser.parse_args()
    if args.only != "transformer":
        mlp_rows(args.mlp_steps, warmup=2, setups=args.setup, memory=not args.no_rss, fixed=args.fixed_heap)
    if args.only == "mlp":
        return
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
