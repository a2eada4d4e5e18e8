"""Muon and Adafactor on sharded parameters: correctness table and step cost of ShardedMatrixOptimizer.

Part 1 (the issue's table): 2 ranks, a two-layer bias-free MLP, 3 steps, lr 0.02, each compared with the
same model trained in one process (max |difference| of the parameters): PyTorch's ``fully_shard`` with
``torch.optim.X(model.parameters())`` (the usual way), ours the usual way (wrong as PyTorch's: no global
optimizer hook of ours runs in it) and ours through ``ShardedMatrixOptimizer``.

Part 2 (step cost): a stack of bias-free ``Linear(WIDTH, WIDTH)`` layers, each under ``fully_shard``; the
optimizer step alone (gradients from one backward, kept), median ms of alternated steps, max over ranks:
sharded Muon (ours) vs single-process ``torch.optim.Muon`` on the whole model (every rank runs one, the
same work) vs sharded Adam (``torch.optim.Adam`` on the DTensors). Also the bytes each rank sends per
step (the two all-to-alls) over the parameters' bytes, and the per-rank Newton-Schulz FLOPs over total/W.
The same for Adafactor: ours (factored: two all-reduces of factors and norms) against the owner scheme
(a subclass of Adafactor, which takes it) and one process.

    .venv/bin/python bench/bench_matrix_optim.py [--world 2 4] [--width 512] [--depth 8] [--iters 10]
"""

from __future__ import annotations

import argparse
import os
from typing import Any

import torch
import torch.distributed as dist

from _timing import interleaved_median_ms  # bench/ is on sys.path
from tensorplay.testing.distributed import run_distributed

STEPS, LR = 3, 0.02


# ---- part 1: the table -----------------------------------------------------------------

def _mlp() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 32, bias=False), torch.nn.Tanh(),
                               torch.nn.Linear(32, 8, bias=False))


def _train(model: torch.nn.Module, optimizer: Any, rank: int, world: int) -> None:
    for step in range(STEPS):
        g = torch.Generator().manual_seed(step)
        x, y = torch.randn(8, 16, generator=g), torch.randn(8, 8, generator=g)
        (model(x.chunk(world)[rank]) - y.chunk(world)[rank]).pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad()


def _full(model: torch.nn.Module) -> list[torch.Tensor]:
    return [(p.full_tensor() if hasattr(p, "full_tensor") else p).detach() for p in model.parameters()]


def correctness_rank() -> dict[str, str]:
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    from tensorplay.distributed.fsdp import fully_shard
    from tensorplay.distributed.optim import ShardedMatrixOptimizer

    rank, world = dist.get_rank(), dist.get_world_size()
    out = {}
    for name in ("Adam", "Muon", "Adafactor"):
        cls = getattr(torch.optim, name)
        reference, initial = _mlp(), _full(_mlp())
        _train(reference, cls(reference.parameters(), lr=LR), 0, 1)
        want = _full(reference)
        out[f"{name} update"] = f"{max((w - i).abs().max().item() for w, i in zip(want, initial, strict=True)):.2g}"
        for impl in ("torch", "ours", "ours_wrapper"):
            model = _mlp()
            (torch_fully_shard if impl == "torch" else fully_shard)(model)
            params = model.parameters()
            wrapped = impl == "ours_wrapper" and name != "Adam"
            optimizer = ShardedMatrixOptimizer(cls, params, lr=LR) if wrapped else cls(params, lr=LR)
            try:
                _train(model, optimizer, rank, world)
                diff = max((g - w).abs().max().item() for g, w in zip(_full(model), want, strict=True))
                out[f"{name} {impl}"] = f"{diff:.1g} off ({'right' if diff < 1e-5 else 'silently wrong'})"
            except Exception as error:  # noqa: BLE001 (the table reports what each raises)
                out[f"{name} {impl}"] = f"raises {type(error).__name__}: {str(error)[:60]}..."
            dist.barrier()
    return out


# ---- part 2: step cost ----------------------------------------------------------------------------

def _stack(width: int, depth: int) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(*[torch.nn.Linear(width, width, bias=False) for _ in range(depth)])


def _with_grads(model: torch.nn.Module, width: int) -> torch.nn.Module:
    model(torch.randn(8, width)).square().mean().backward()
    return model


class _SentBytes:
    """Bytes this rank hands to ``all_to_all_single`` (what it sends, its own piece included) and ``all_reduce``.

    (Our all-reduce of 64 KiB or more may go through shared memory instead; the factors here are smaller.)
    """

    def __init__(self) -> None:
        self.total = 0

    def __enter__(self) -> _SentBytes:
        self.originals = dist.all_to_all_single, dist.all_reduce
        to_all, reduce = self.originals

        def counted_to_all(output: torch.Tensor, input: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            self.total += input.numel() * input.element_size()
            return to_all(output, input, *args, **kwargs)

        def counted_reduce(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            self.total += tensor.numel() * tensor.element_size()
            return reduce(tensor, *args, **kwargs)

        dist.all_to_all_single, dist.all_reduce = counted_to_all, counted_reduce
        return self

    def __exit__(self, *exc: object) -> None:
        dist.all_to_all_single, dist.all_reduce = self.originals


class _OwnerAdafactor(torch.optim.Adafactor):
    """Adafactor through the owner scheme (a subclass is not factored): the scheme it had before, for comparison."""


def _sent_over_params(optimizer: Any, param_bytes: int) -> float:
    with _SentBytes() as sent:
        optimizer.step()
    return sent.total / param_bytes


def cost_rank(width: int, depth: int, iters: int) -> dict[str, float]:
    import torch.optim._muon as muon

    from tensorplay.distributed.fsdp import fully_shard
    from tensorplay.distributed.optim import ShardedMatrixOptimizer
    from tensorplay.distributed.optim.matrix._layout import newton_schulz_flops

    torch.set_num_threads(1)
    sharded = {name: _stack(width, depth) for name in ("muon", "adam", "adafactor", "owner_adafactor")}
    for model in sharded.values():
        for layer in model:
            fully_shard(layer)
        fully_shard(model)
        _with_grads(model, width)
    single = _with_grads(_stack(width, depth), width)
    single_adafactor = _with_grads(_stack(width, depth), width)
    optimizers = {
        "sharded Muon": ShardedMatrixOptimizer(torch.optim.Muon, sharded["muon"].parameters(), lr=LR),
        "one-process Muon": torch.optim.Muon(single.parameters(), lr=LR),
        "sharded Adam": torch.optim.Adam(sharded["adam"].parameters(), lr=LR),
        "sharded Adafactor": ShardedMatrixOptimizer(torch.optim.Adafactor, sharded["adafactor"].parameters(), lr=LR),
        "owner Adafactor": ShardedMatrixOptimizer(_OwnerAdafactor, sharded["owner_adafactor"].parameters(), lr=LR),
        "one-process Adafactor": torch.optim.Adafactor(single_adafactor.parameters(), lr=LR)}
    times = interleaved_median_ms({name: opt.step for name, opt in optimizers.items()}, warmup=2, iters=iters)

    shapes: list[tuple[int, ...]] = []
    original = muon._zeropower_via_newtonschulz

    def counted(grad: torch.Tensor, *args: Any) -> torch.Tensor:
        shapes.append(tuple(grad.shape))
        return original(grad, *args)

    muon._zeropower_via_newtonschulz = counted
    try:
        with _SentBytes() as sent:
            optimizers["sharded Muon"].step()
    finally:
        muon._zeropower_via_newtonschulz = original
    param_bytes = sum(p.numel() * p.element_size() for p in single.parameters())
    flops = sum(newton_schulz_flops(shape, 5) for shape in shapes)
    total_flops = sum(newton_schulz_flops(tuple(p.shape), 5) for p in single.parameters())
    return {**times, "sent_over_params": sent.total / param_bytes,
            "flops_over_even": flops / (total_flops / dist.get_world_size()),
            "adafactor_sent": _sent_over_params(optimizers["sharded Adafactor"], param_bytes),
            "owner_adafactor_sent": _sent_over_params(optimizers["owner Adafactor"], param_bytes)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--world", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--depth", type=int, default=8)
    parser.add_argument("--iters", type=int, default=10)
    args = parser.parse_args()

    table = run_distributed(correctness_rank, world_size=2)[0]
    print(f"2 ranks, Linear(16, 32) -> Tanh -> Linear(32, 8), no bias, {STEPS} steps, lr {LR}; "
          "max |param - one-process param|\n")
    print("| optimizer | PyTorch's fully_shard | ours, usual way | ours, ShardedMatrixOptimizer | update size |")
    print("|---|---|---|---|---|")
    for name in ("Adam", "Muon", "Adafactor"):
        wrapper = table[f"{name} ours_wrapper"] if name != "Adam" else "(not needed)"
        print(f"| {name} | {table[f'{name} torch']} | {table[f'{name} ours']} | {wrapper} | "
              f"{table[f'{name} update']} |")

    print(f"\nstep cost: {args.depth} x Linear({args.width}, {args.width}), no bias, each under fully_shard; "
          f"optimizer step only, median ms of {args.iters} alternated steps, max over ranks; Gloo, 1 thread "
          f"per rank, {os.cpu_count()} cores\n")
    print("| ranks | sharded Muon ms | one-process Muon ms | sharded Adam ms | sharded / one-process Muon "
          "| sharded Muon / sharded Adam | bytes sent per rank / param bytes | NS FLOPs per rank / (total/W), max |")
    print("|---|---|---|---|---|---|---|---|")
    rows: list[dict[str, float]] = []
    for world in args.world:
        ranks = run_distributed(cost_rank, args.width, args.depth, args.iters, world_size=world)
        worst = {key: max(r[key] for r in ranks) for key in ranks[0]}
        print(f"| {world} | {worst['sharded Muon']:.1f} | {worst['one-process Muon']:.1f} | "
              f"{worst['sharded Adam']:.1f} | {worst['sharded Muon'] / worst['one-process Muon']:.2f} | "
              f"{worst['sharded Muon'] / worst['sharded Adam']:.2f} | {worst['sent_over_params']:.2f} | "
              f"{worst['flops_over_even']:.2f} |")
        rows.append(worst)

    print("\nAdafactor, the same stack and timing: factored (ours: factors and norms all-reduced) vs the owner "
          "scheme (each matrix gathered to one rank and back) vs one process\n")
    print("| ranks | factored ms | owner scheme ms | one-process ms | bytes sent per rank / param bytes: factored "
          "| owner scheme |")
    print("|---|---|---|---|---|---|")
    for world, worst in zip(args.world, rows, strict=True):
        print(f"| {world} | {worst['sharded Adafactor']:.1f} | {worst['owner Adafactor']:.1f} | "
              f"{worst['one-process Adafactor']:.1f} | {worst['adafactor_sent']:.4f} | "
              f"{worst['owner_adafactor_sent']:.2f} |")


if __name__ == "__main__":
    main()
