"""Shared training loop for the ZeRO parity tests: ours, PyTorch's ZeRO, and DDP + the plain optimizer.

Every run builds the same seeded model on every rank, wraps it in DDP, feeds
each rank its own data and returns the parameters (and whatever the test asks).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.optim import ZeroRedundancyOptimizer as TorchZeRO
from torch.nn.parallel import DistributedDataParallel as DDP

import tensorplay as tp
from tensorplay.distributed.optim.zero import _chunked_step as chunked_step
from tensorplay.distributed.optim.zero import _optimizer as zero_module
from tensorplay.distributed.optim.zero import _sync as zero_sync
from tensorplay.distributed.optim.zero_redundancy_optimizer import (
    ZeroRedundancyOptimizer,
)

from tests.common import assert_equal_tensors

DEFAULT_UNIT_NUMEL, DEFAULT_SMALL_NUMEL = zero_module.PIPELINE_UNIT_NUMEL, zero_sync.SMALL_NUMEL
DEFAULT_CHUNK_NUMEL = chunked_step.CHUNK_NUMEL
IMPLS = ("ours", "torch", "plain")
OPTIMIZERS = {"adam": (tp.optim.Adam, {"lr": 0.01}), "sgd": (tp.optim.SGD, {"lr": 0.05, "momentum": 0.9}),
              "adamw": (tp.optim.AdamW, {"lr": 0.01, "weight_decay": 0.1})}


class Net(tp.nn.Module):
    """Mixed sizes; ``mixed_dtype`` makes the head float64 (a second bucket key)."""

    def __init__(self, mixed_dtype: bool = False, unused: bool = False) -> None:
        super().__init__()
        self.body = tp.nn.Sequential(tp.nn.Linear(6, 10), tp.nn.ReLU(), tp.nn.Linear(10, 8), tp.nn.ReLU())
        self.head = tp.nn.Linear(8, 3)
        self.spare = tp.nn.Linear(3, 3) if unused else None
        if mixed_dtype:
            self.head.double()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x).to(self.head.weight.dtype))


def make_model(seed: int = 0, **kwargs: Any) -> Net:
    torch.manual_seed(seed)
    return Net(**kwargs)


def batch(step: int, rows: int = 5) -> torch.Tensor:
    """Rank- and step-specific inputs."""
    g = torch.Generator().manual_seed(1000 * dist.get_rank() + step)
    return torch.randn(rows, 6, generator=g)


def build(impl: str, params: Any, opt: str, **zero_kwargs: Any) -> Any:
    cls, options = OPTIMIZERS[opt]
    if impl == "ours":
        return ZeroRedundancyOptimizer(params, cls, **zero_kwargs, **options)
    if impl == "torch":
        return TorchZeRO(params, cls, **zero_kwargs, **options)
    return cls(params, **options)


def train(impl: str, opt: str = "adam", steps: int = 4, bucket: bool = False, scheduler: bool = False,
          add_group_at: int | None = None, frozen: bool = False, mixed_dtype: bool = False,
          unused: bool = False, unit_numel: int | None = None, small_numel: int | None = None,
          chunk_numel: int | None = None) -> dict[str, Any]:
    if chunk_numel is not None:  # the tiny model's parameters stepped in chunks (see [Note: chunked step])
        chunked_step.CHUNK_NUMEL = chunk_numel
    if unit_numel is not None:  # several pipelined units even for a tiny model
        zero_module.PIPELINE_UNIT_NUMEL = unit_numel
    if small_numel is not None:  # some parameters broadcast alone, the rest packed
        zero_sync.SMALL_NUMEL = small_numel
    model = make_model(mixed_dtype=mixed_dtype, unused=unused)
    if frozen:
        model.body[0].weight.requires_grad_(False)
    ddp = DDP(model, find_unused_parameters=unused)
    late = list(model.head.parameters())
    early = [p for p in model.parameters() if all(p is not q for q in late)]
    params = [{"params": early}] if add_group_at is not None else list(model.parameters())
    zero_kwargs = {} if impl == "plain" else {"parameters_as_bucket_view": bucket}
    optimizer = build(impl, params, opt, **zero_kwargs)
    sched = tp.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5) if scheduler else None
    losses = []
    for step in range(steps):
        if step == add_group_at:
            optimizer.add_param_group({"params": late, "lr": 0.02})
        optimizer.zero_grad()
        loss = ddp(batch(step)).pow(2).sum()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
        if sched is not None:
            sched.step()
    zero_module.PIPELINE_UNIT_NUMEL, zero_sync.SMALL_NUMEL = DEFAULT_UNIT_NUMEL, DEFAULT_SMALL_NUMEL
    chunked_step.CHUNK_NUMEL = DEFAULT_CHUNK_NUMEL
    return {"params": [p.detach().clone() for p in model.parameters()], "losses": losses,
            "partition": partition_of(impl, optimizer)}


def partition_of(impl: str, optimizer: Any) -> list[list[list[int]]] | None:
    """Per rank, per group: positions of the owned parameters (sorted), from either ZeRO."""
    if impl == "ours":
        return [[sorted(positions) for positions in rank] for rank in optimizer._owned]
    if impl == "torch":
        groups = [g["params"] for g in optimizer.param_groups]
        return [[sorted(next(i for i, q in enumerate(groups[g]) if q is p) for p in rank_group["params"])
                 for g, rank_group in enumerate(rank)] for rank in optimizer._partition_parameters()]
    return None


def train_all(**kwargs: Any) -> dict[str, dict[str, Any]]:
    return {impl: train(impl, **kwargs) for impl in IMPLS}


def assert_same_params(results: list[dict[str, dict[str, Any]]], impls: tuple[str, ...] = IMPLS) -> None:
    """Bitwise equal across implementations and across ranks."""
    reference = results[0][impls[0]]["params"]
    for rank, per_impl in enumerate(results):
        for impl in impls:
            assert_equal_tensors(per_impl[impl]["params"], reference, f"rank {rank}, {impl} vs rank 0's {impls[0]}")
