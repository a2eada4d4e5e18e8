"""The seed's "Mixed precision" example (seeds/distributed-fsdp.txt) on 2 Gloo ranks, as written.

Only the init line differs: the harness's ranks already run in a default Gloo
group. ``ShardedGradScaler()`` keeps its default device="cuda", so on a CPU-only
machine this also proves the scaler scales for real instead of disabling itself.
Checked against PyTorch's fully_shard + ShardedGradScaler(device="cpu") on the
same loop (bitwise) and against the unsharded, unscaled loop.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch

import tensorplay as tp
import tensorplay.distributed as dist
from tensorplay.distributed.tensor import DTensor
from tensorplay.testing.distributed import run_distributed


def seed_example() -> tuple[Any, Any]:
    # ---- verbatim from seeds/distributed-fsdp.txt, "Mixed precision" ----
    import tensorplay as tp
    import tensorplay.nn as nn
    from tensorplay.distributed.fsdp import fully_shard
    from tensorplay.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

    model = nn.Linear(64, 64)
    fully_shard(model)
    scaler = ShardedGradScaler()
    optimizer = tp.optim.SGD(model.parameters(), lr=0.1)

    for x in (tp.randn(8, 64) for _ in range(2)):
        loss = model(x).sum()
        scaler.scale(loss).backward()
        scaler.step(optimizer)   # skips together if any rank overflowed
        scaler.update()
        model.zero_grad()
    # ---- end of the seed ----
    return model, scaler


def pytorch_example() -> tuple[Any, Any]:
    """The same loop on PyTorch's fully_shard and ShardedGradScaler (device="cpu": its default disables)."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

    model = torch.nn.Linear(64, 64)
    fully_shard(model)
    scaler = ShardedGradScaler(device="cpu")
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for x in (torch.randn(8, 64) for _ in range(2)):
        scaler.scale(model(x).sum()).backward()
        scaler.step(optimizer)
        scaler.update()
        model.zero_grad()
    return model, scaler


def unsharded_example() -> list[torch.Tensor]:
    """Unscaled, unsharded; every rank draws the same batches, so the rank-averaged gradient is one rank's."""
    model = tp.nn.Linear(64, 64)
    optimizer = tp.optim.SGD(model.parameters(), lr=0.1)
    for x in (tp.randn(8, 64) for _ in range(2)):
        model(x).sum().backward()
        optimizer.step()
        model.zero_grad()
    world, rank = dist.get_world_size(), dist.get_rank()
    return [p.detach().chunk(world)[rank].clone() for p in model.parameters()]


def _shards(model: torch.nn.Module) -> list[torch.Tensor]:
    return [(p.to_local() if isinstance(p, DTensor) else p).detach().clone() for p in model.parameters()]


def three_runs() -> dict[str, Any]:
    tp.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the one-time CPU fallback warning of device="cuda"
        model, scaler = seed_example()
    runs: dict[str, Any] = {"ours": _shards(model), "enabled": scaler.is_enabled(),
                            "scale": scaler.get_scale(), "scaled": scaler._scale is not None}
    tp.manual_seed(0)
    runs["torch"] = _shards(pytorch_example()[0])
    tp.manual_seed(0)
    runs["unsharded"] = unsharded_example()
    return runs


def test_seed_mixed_precision_example_runs_on_two_ranks():
    for runs in run_distributed(three_runs, world_size=2):
        # Enabled and scaling for real, where PyTorch's default device="cuda" disables itself without CUDA.
        assert runs["enabled"] and runs["scaled"] and runs["scale"] == 2.0**16
        for ours, theirs, unsharded in zip(runs["ours"], runs["torch"], runs["unsharded"], strict=True):
            assert torch.equal(ours, theirs)
            torch.testing.assert_close(ours, unsharded, rtol=1e-6, atol=1e-6)
