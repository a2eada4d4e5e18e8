"""DistributedOptimizer over RPC: step latency with two (``--owners``) parameter owners.

TensorPipe workers on loopback: worker0 drives, worker1 and worker2 (more with
``--owners``) each own the same shapes of parameters. One distributed-autograd
backward fills a context, then ``step(context_id)`` is timed for ours
(``tensorplay.distributed.optim.DistributedOptimizer``) and PyTorch's
(``torch.distributed.optim.DistributedOptimizer``), interleaved round-robin on
the same gradients; the best of three medians is printed in milliseconds, with
the ratio of those and the median of the per-pair ratios (each step of ours over
the PyTorch step right after it: robust to load that drifts during the run).
Goal: ours <= 1.05x.

Both sides run the TorchScript-free update for NAdam (no functional form: each
owner runs the class optimizer, setting ``.grad``). For SGD and Adam both owners
step in TorchScript: PyTorch's compiles its functional optimizer, ours its
per-tensor update (``_script_updates``, bitwise equal results), reached through
a small TorchScript RPC function and the owner's lock.

    .venv/bin/python bench/bench_rpc.py [--cases "1M SGD" ...] [--iters 60] [--owners 4] [--profile]

``--owners 4`` runs five processes on this 2-core machine (oversubscribed:
ratios still hold side by side). ``--profile`` also times, on one owner, the
phases of one step (each run in a loop on the owner, interleaved): the owner's
whole step, its TorchScript part, the Python functional step it replaced, and
PyTorch's scripted owner step; and, from the driver, an empty TorchScript RPC
to every owner.
"""

from __future__ import annotations

import argparse
import functools
import logging
import statistics
import time
import warnings
from typing import Any

import torch
import torch.distributed.optim as torch_dist_optim

import tensorplay as tp
import tensorplay.distributed.autograd as dist_autograd
import tensorplay.distributed.rpc as rpc
from _timing import interleaved_median_ms  # bench/ is on sys.path when run as a script
from tensorplay.distributed.optim.optimizer import _REGISTRY, DistributedOptimizer
from tensorplay.testing.distributed import run_rpc

WARMUP, ITERS, ROUNDS = 10, 60, 3
OWNERS = 2  # parameter owners (worker1 ...); --owners changes it
#: name -> shapes of the parameters on each owner.
SIZES: dict[str, list[tuple[int, ...]]] = {
    "small (8 x 64x64)": [(64, 64)] * 8,
    "1M / owner (4 x 512x512)": [(512, 512)] * 4,
}
#: Short names for --cases: "<size> <optimizer>", e.g. "1M SGD".
SIZE_KEYS = {"small": "small (8 x 64x64)", "1M": "1M / owner (4 x 512x512)"}
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


def _owners() -> list[str]:
    """The workers that own parameters: every worker but the driver (worker0)."""
    return [f"worker{rank}" for rank in range(1, len(rpc._get_current_rpc_agent().get_worker_infos()))]


def _filled_context(shapes: list[tuple[int, ...]]) -> tuple[Any, list[rpc.RRef]]:
    """A distributed autograd context holding gradients for every parameter on every owner."""
    holders = [rpc.remote(owner, _new_params, args=(shapes, i)) for i, owner in enumerate(_owners())]
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


def _owner_phases(key: int, theirs: rpc.RRef, context_id: int, iters: int) -> dict[str, float]:
    """Median ms of each phase of one owner's step, timed on the owner, interleaved."""
    owner = _REGISTRY[key]
    grads = [dist_autograd.get_gradients(context_id).get(p) for p in owner.params]
    phases = {
        "owner step, ours (lock + TorchScript)": functools.partial(owner.step, context_id),
        "  its TorchScript part (get_gradients + update)": functools.partial(owner._script.step, context_id),
        "  get_gradients + list, in Python": lambda: [dist_autograd.get_gradients(context_id).get(p)
                                                      for p in owner.params],
        "  Python functional step (the step before)": functools.partial(owner.optimizer.step, grads),
        "owner step, PyTorch's (TorchScript)": functools.partial(theirs.local_value().step, context_id),
    }
    return interleaved_median_ms(phases, warmup=WARMUP, iters=iters, rounds=ROUNDS)


@torch.jit.script
def _empty_step(key: int, context_id: int) -> None:
    pass


def _profile(ours: DistributedOptimizer, theirs: Any, context_id: int, iters: int) -> dict[str, float]:
    owner = ours._owners[0]
    phases = rpc.rpc_sync(owner.worker, _owner_phases, args=(owner.key, theirs.remote_optimizers[0], context_id,
                                                             iters))
    def empty() -> None:
        for future in [rpc.rpc_async(o.worker, _empty_step, args=(o.key, context_id)) for o in ours._owners]:
            future.wait()
    phases["driver: empty TorchScript RPC to every owner"] = interleaved_median_ms(
        {"empty": empty}, warmup=WARMUP, iters=iters, rounds=ROUNDS)["empty"]
    return phases


def _pair_ratio(steppers: dict[str, Any], pairs: int) -> float:
    """Median over ``pairs`` of (our step time / PyTorch's step time right after it)."""
    ratios = []
    for _ in range(pairs):
        times = {}
        for key, step in steppers.items():
            start = time.perf_counter()
            step()
            times[key] = time.perf_counter() - start
        ratios.append(times["ours"] / times["pytorch"])
    return statistics.median(ratios)


def _driver(cases: list[tuple[str, str]], iters: int, profile: bool
            ) -> list[tuple[str, str, dict[str, float], dict[str, float]]] | None:
    if rpc.get_worker_info().name != "worker0":
        return None
    for worker in ("worker0", *_owners()):
        rpc.rpc_sync(worker, _mute_warnings)
    rows = []
    for size_name, case_name in cases:
        optimizer_class, kwargs = next((cls, kw) for name, cls, kw in CASES if name == case_name)
        (context, context_id, _holders), param_rrefs = _filled_context(SIZES[size_name])
        ours = DistributedOptimizer(optimizer_class, param_rrefs, **kwargs)
        theirs = torch_dist_optim.DistributedOptimizer(optimizer_class, param_rrefs, **kwargs)
        steppers = {"ours": functools.partial(ours.step, context_id),
                    "pytorch": functools.partial(theirs.step, context_id)}
        ms = interleaved_median_ms(steppers, warmup=WARMUP, iters=iters, rounds=ROUNDS)
        ms["pair"] = _pair_ratio(steppers, iters * ROUNDS)
        phases = _profile(ours, theirs, context_id, iters) if profile and ours.is_functional_optim else {}
        context.__exit__(None, None, None)
        rows.append((size_name, case_name, ms, phases))
    return rows


def _selected(names: list[str] | None) -> list[tuple[str, str]]:
    """(size, optimizer case) pairs: all by default, else those named "<size> <optimizer>"."""
    every = [(size, case[0]) for size in SIZES for case in CASES]
    if not names:
        return every
    chosen = []
    for name in names:
        size_key, _, optimizer = name.partition(" ")
        matches = [(size, case) for size, case in every
                   if size == SIZE_KEYS.get(size_key) and case.split(" ")[0] == optimizer]
        if not matches:
            raise SystemExit(f"--cases: unknown case {name!r}; use '<{'|'.join(SIZE_KEYS)}> "
                             f"<{'|'.join(c[0].split(' ')[0] for c in CASES)}>', e.g. '1M SGD'")
        chosen += matches
    return chosen


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--cases", nargs="+", default=None, help='e.g. "1M SGD" "small Adam" (default: all)')
    parser.add_argument("--iters", type=int, default=ITERS)
    parser.add_argument("--profile", action="store_true", help="also time the phases of one owner's step")
    parser.add_argument("--owners", type=int, default=OWNERS, help="parameter owners (each one more process)")
    args = parser.parse_args()
    rows = run_rpc(_driver, _selected(args.cases), args.iters, args.profile, world_size=args.owners + 1,
                   timeout=600)[0]
    print(f"{args.owners + 1} TensorPipe workers on loopback (driver + {args.owners} owners), 1 thread each; "
          f"best of {ROUNDS} medians of {args.iters} interleaved steps (ms); ratio of those "
          f"(median of {ROUNDS * args.iters} per-pair ratios)\n")
    print("| params per owner | optimizer | ours | PyTorch | ours / PyTorch |")
    print("|---|---|---|---|---|")
    for size_name, case_name, ms, _ in rows:
        print(f"| {size_name} | {case_name} | {ms['ours']:.2f} | {ms['pytorch']:.2f} | "
              f"{ms['ours'] / ms['pytorch']:.2f}x ({ms['pair']:.2f}x) |")
    for size_name, case_name, _, phases in rows:
        if phases:
            print(f"\nOne owner's step, {size_name}, {case_name}: median us (best of {ROUNDS} rounds)")
            for phase, ms_value in phases.items():
                print(f"  {phase:50s} {ms_value * 1e3:8.1f}")


if __name__ == "__main__":
    main()
