"""AdamW stepped in backward vs after backward, under fully_shard or DDP, on the recipe's model (Gloo, CPU).

Per world size (2, 4) and setting, a fresh process group trains ``examples/lm_model.ByteLM`` wrapped as
``examples/train_lm.py --strategy fully_shard`` wraps it (one group per block, then the root), or with
``--front-end ddp`` in ``DistributedDataParallel`` (in backward: each bucket steps once it is averaged):

* ``after``: ``AdamW.step()`` after backward (the baseline); ``after+clip``: ``clip_grad_norm_`` first;
* ``in-backward``: ``apply_optimizer_in_backward`` (each group steps as its reduce-scatter lands);
* ``exact`` / ``previous``: in backward with ``max_norm=1.0`` in that clipping mode.

Columns: the median step time (rank 0, all ranks released together), and each rank's peak RSS *during
training* (the high-water mark is reset after the model and optimizer are built, via
``/proc/self/clear_refs``), worst rank, with glibc's mmap threshold fixed so freed gradients leave the
RSS (see [Note: peak RSS with a fixed mmap threshold] in ``_timing.py``). ``grad MiB`` is the most
gradient bytes a rank held at once (sharded ``.grad`` at the end of a backward for ``after``; counted at
every hand-out for the in-backward settings). Ratios are against ``after`` (or ``after+clip`` for the
clipping modes).

    .venv/bin/python bench/bench_optim_in_backward.py [--world 2 4] [--dim 512] [--layers 8] [--steps 4]
                                                      [--front-end fully_shard|ddp]

Under DDP the reducer's buckets, which persist across steps, hold every gradient whatever the setting, so
the peak does not move there; what in-backward changes is when the optimizer runs (2 ranks, dim 256, 4
layers, 2026-12-03: peak RSS 386-388 MiB for every setting).

With a large batch the activations, not the gradients, set the peak (it comes early in backward,
before gradients pile up), and the settings' peaks are equal; the default batch keeps activations
small, as a memory-bound fine-tuning run does.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))

from _timing import fixed_heap, rank_step_timer  # noqa: E402  (bench/ is on sys.path)
from tensorplay.testing.distributed import run_distributed, shutdown_workers  # noqa: E402

SETTINGS = ("after", "in-backward", "after+clip", "exact", "previous")
BASELINE = {"in-backward": "after", "exact": "after+clip", "previous": "after+clip"}
MiB = 2**20
WARMUP = 2


def _reset_peak_rss() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as refs:
            refs.write("5")  # resets VmHWM, the peak RSS
        return True
    except OSError:
        return False


def _peak_rss_mib() -> float:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) / 1024 for line in status if line.startswith("VmHWM:"))


def _grad_bytes(model: torch.nn.Module) -> int:
    total = 0
    for param in model.parameters():
        grad = param.grad
        if grad is not None:
            local = grad.to_local() if hasattr(grad, "to_local") else grad
            total += local.numel() * local.element_size()
    return total


def train(setting: str, dim: int, layers: int, steps: int, batch: int, seq: int,
          front_end: str = "fully_shard") -> dict[str, Any]:
    import torch.nn.functional as F

    import tensorplay.distributed as dist
    from lm_model import ByteLM, LMConfig
    from tensorplay.distributed.fsdp import fully_shard
    from tensorplay.distributed.optim.apply_optimizer_in_backward import (
        InBackwardOptions,
        _apply_optimizer_in_backward,
    )

    torch.manual_seed(0)
    model = ByteLM(LMConfig(dim=dim, n_layers=layers, n_heads=8, max_seq_len=512))
    if front_end == "fully_shard":
        for block in model.blocks:
            fully_shard(block)
        fully_shard(model)
    kwargs: dict[str, Any] = {"lr": 1e-3, "betas": (0.9, 0.95), "weight_decay": 0.01}
    optimizer = None
    most_grad = [0]
    if setting.startswith("after"):
        optimizer = torch.optim.AdamW(model.parameters(), **kwargs)
    else:
        clip = {"max_norm": 1.0, "clip_mode": setting} if setting in ("exact", "previous") else {}
        _apply_optimizer_in_backward(torch.optim.AdamW, model.parameters(), kwargs,
                                     options=InBackwardOptions(**clip))  # type: ignore[arg-type]
        _count_grads_at_hand_out(model, most_grad, front_end)
    if front_end == "ddp":
        model = _ddp(model, in_backward=optimizer is None)
    gen = torch.Generator().manual_seed(dist.get_rank())
    times: list[float] = []
    reset = False
    for step in range(WARMUP + steps):
        tokens = torch.randint(0, 256, (batch, seq + 1), generator=gen)
        if step == WARMUP:
            reset = _reset_peak_rss()  # optimizer state exists now: the peak is the training's own
            most_grad[0] = 0  # likewise ("previous" keeps the gradients of its first step: it clips exactly)
        with rank_step_timer(times if step >= WARMUP else None):
            logits = model(tokens[:, :-1])
            F.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten()).backward()
            if optimizer is not None:
                most_grad[0] = max(most_grad[0], _grad_bytes(model))
                if setting == "after+clip":
                    torch.nn.utils.clip_grad_norm_(list(model.parameters()), 1.0)
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
    return {"step_ms": statistics.median(times), "peak_mib": _peak_rss_mib(), "reset": reset,
            "grad_mib": most_grad[0] / MiB}


def _ddp(model: torch.nn.Module, in_backward: bool) -> torch.nn.Module:
    from tensorplay.distributed.algorithms.ddp_comm_hooks.optimizer_overlap_hooks import (
        _register_optim_in_backward_hook,
    )

    ddp = torch.nn.parallel.DistributedDataParallel(model)
    if in_backward:
        _register_optim_in_backward_hook(ddp)
    return ddp


def _count_grads_at_hand_out(model: torch.nn.Module, most: list[int], front_end: str) -> None:
    """Record the gradient bytes alive each time a parameter's gradient is handed out (before its step)."""
    import importlib

    module = importlib.import_module("tensorplay.distributed.fsdp._fully_shard._fsdp_optim_in_backward"
                                     if front_end == "fully_shard"
                                     else "tensorplay.distributed.optim.apply_optimizer_in_backward")
    original = module.grad_ready

    def counted(param: torch.Tensor, shard_groups: tuple[object, ...] = ()) -> None:
        most[0] = max(most[0], _grad_bytes(model))
        original(param, shard_groups)

    setattr(module, "grad_ready", counted)  # noqa: B010  # this worker process only


def measure(world: int, args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    rows = {}
    for setting in SETTINGS:
        shutdown_workers()  # a fresh group per setting: its peak RSS is its own
        with fixed_heap():
            per_rank = run_distributed(train, setting, args.dim, args.layers, args.steps, args.batch, args.seq,
                                       args.front_end, world_size=world, timeout=1800)
        rows[setting] = {"step_ms": per_rank[0]["step_ms"], "peak_mib": max(r["peak_mib"] for r in per_rank),
                         "grad_mib": max(r["grad_mib"] for r in per_rank),
                         "reset": all(r["reset"] for r in per_rank)}
    shutdown_workers()
    return rows


def table(results: dict[int, dict[str, dict[str, Any]]], params_m: float, front_end: str = "fully_shard") -> str:
    lines = [f"{front_end}, ByteLM {params_m:.1f}M parameters, AdamW; peak RSS during training, worst rank",
             "",
             "| world | setting | step ms | ratio | peak RSS MiB | ratio | grad MiB held |",
             "|---|---|---|---|---|---|---|"]
    for world, rows in results.items():
        for setting, row in rows.items():
            base = rows.get(BASELINE.get(setting, setting))
            assert base is not None
            lines.append(f"| {world} | {setting} | {row['step_ms']:.0f} | {row['step_ms'] / base['step_ms']:.2f} | "
                         f"{row['peak_mib']:.0f} | {row['peak_mib'] / base['peak_mib']:.2f} | "
                         f"{row['grad_mib']:.1f} |")
    if not all(row["reset"] for rows in results.values() for row in rows.values()):
        lines.append("\n(peak RSS could not be reset here: it includes start-up)")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--dim", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--steps", type=int, default=4)
    # A small batch: the activations stay below the gradients, so the peak is where gradients pile up.
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--seq", type=int, default=16)
    parser.add_argument("--front-end", choices=("fully_shard", "ddp"), default="fully_shard")
    args = parser.parse_args()
    from lm_model import ByteLM, LMConfig, num_params

    params_m = num_params(ByteLM(LMConfig(dim=args.dim, n_layers=args.layers, n_heads=8, max_seq_len=512))) / 1e6
    results: dict[int, dict[str, dict[str, Any]]] = {}
    for world in args.world:
        results[world] = measure(world, args)
        print(table({world: results[world]}, params_m, args.front_end) + "\n", flush=True)  # each world as it finishes


if __name__ == "__main__":
    main()
