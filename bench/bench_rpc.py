"""DistributedOptimizer over RPC: step latency with two parameter owners.

Three TensorPipe workers on loopback: worker0 drives, worker1 and worker2 each
own half of the parameters. One distributed-autograd backward fills a context,
then ``step(context_id)`` is timed for ours
(``tensorplay.distributed.optim.DistributedOptimizer``) and PyTorch's
(``torch.distributed.optim.DistributedOptimizer``), interleaved round-robin on
the same gradients; the best of three medians is printed in milliseconds.
Goal: ours <= 1.1x.

    .venv/bin/python bench/bench_rpc.py
"""

from __future__ import annotations

import functools
import logging
import warnings
from typing import Any

import torch
import torch.distributed.optim as torch_dist_optim

import tensorplay as tp
import tensorplay.distributed.autograd as dist_autograd
import tensorplay.distributed.rpc as rpc
from _timing import interleaved_median_ms  # bench/ is on sys.path when run as a script
from tensorplay.distributed.optim.optimizer import DistributedOptimizer
from tensorplay.testing.distributed import run_rpc

WARMUP, ITERS, ROUNDS = 10, 60, 3
OWNERS = ("worker1", "worker2")
#: name -> shapes of the parameters on each owner.
SIZES: dict[str, list[tuple[int, ...]]] = {
    "small (8 x 64x64)": [(64, 64)] * 8,
    "1M / owner (4 x 512x512)": [(512, 512)] * 4,
}
CASES: list[tuple[str, type, dict[str, Any]]] = [
    ("SGD", tp.optim.SGD, {"lr": 1e-3, "momentum": 0.9}),
    ("Adam", tp.optim.Adam, {"lr": 1e-3}),
    ("NAdam (class fallback)", tp.optim.NAdam, {"lr": 1e-3}),
]


def _new_params(shapes: list[tuple[int, ...]], seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=gen).requires_grad_() for shape in shapes]


def _param_rrefs(params_rref: rpc.RRef) -> list[rpc.RRef]:
    return [rpc.RRef(p) for p in params_rref.local_value()]


def _loss(params_rref: rpc.RRef) -> torch.Tensor:
    return sum((p * p).sum() for p in params_rref.local_value())


def _filled_context(shapes: list[tuple[int, ...]]) -> tuple[Any, list[rpc.RRef]]:
    """A distributed autograd context holding gradients for every parameter on both owners."""
    holders = [rpc.remote(owner, _new_params, args=(shapes, i)) for i, owner in enumerate(OWNERS)]
    param_rrefs = [r for h in holders for r in rpc.rpc_sync(h.owner(), _param_rrefs, args=(h,))]
    context = dist_autograd.context()
    context_id = context.__enter__()
    loss = sum(rpc.rpc_sync(h.owner(), _loss, args=(h,)) for h in holders)
    dist_autograd.backward(context_id, [loss])
    return (context, context_id, holders), param_rrefs


def _mute_warnings() -> None:
    # PyTorch's DistributedOptimizer warns on every worker (TorchScript deprecation, no-TorchScript
    # fallback), some of it through any filter.
    warnings.showwarning = lambda *args, **kwargs: None
    logging.getLogger("torch.distributed.optim.optimizer").setLevel(logging.ERROR)


def _driver() -> list[tuple[str, str, dict[str, float]]] | None:
    if rpc.get_worker_info().name != "worker0":
        return None
    for worker in ("worker0", *OWNERS):
        rpc.rpc_sync(worker, _mute_warnings)
    rows = []
    for size_name, shapes in SIZES.items():
        for case_name, optimizer_class, kwargs in CASES:
            (context, context_id, _holders), param_rrefs = _filled_context(shapes)
            ours = DistributedOptimizer(optimizer_class, param_rrefs, **kwargs)
            theirs = torch_dist_optim.DistributedOptimizer(optimizer_class, param_rrefs, **kwargs)
            steppers = {"ours": functools.partial(ours.step, context_id),
                        "pytorch": functools.partial(theirs.step, context_id)}
            ms = interleaved_median_ms(steppers, warmup=WARMUP, iters=ITERS, rounds=ROUNDS)
            context.__exit__(None, None, None)
            rows.append((size_name, case_name, ms))
    return rows


def main() -> None:
    rows = run_rpc(_driver, world_size=3, timeout=300)[0]
    print(f"3 TensorPipe workers on loopback (driver + 2 owners), 1 thread each; "
          f"best of {ROUNDS} medians of {ITERS} interleaved steps (ms)\n")
    print("| params per owner | optimizer | ours | PyTorch | ours / PyTorch |")
    print("|---|---|---|---|---|")
    for size_name, case_name, ms in rows:
        print(f"| {size_name} | {case_name} | {ms['ours']:.2f} | {ms['pytorch']:.2f} | "
              f"{ms['ours'] / ms['pytorch']:.2f}x |")


if __name__ == "__main__":
    main()
