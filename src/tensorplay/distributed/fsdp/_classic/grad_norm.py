"""``clip_grad_norm_`` of a classic FSDP model: one global norm over sharded and replicated gradients."""

from __future__ import annotations

import math
import warnings
from collections.abc import Iterable

import torch
from torch import nn

import tensorplay.distributed as dist
from tensorplay.distributed._comm import collectives

from .unit_state import UnitState


@torch.no_grad()
def clip_grad_norm_(units: list[UnitState], parameters: Iterable[nn.Parameter], max_norm: float,
                    norm_type: float, device: torch.device, group: dist.ProcessGroup | None) -> torch.Tensor:
    """Scale all gradients so their global ``norm_type`` norm is at most ``max_norm``; return that norm.

    ``parameters``: every parameter of the model. Gradients of the units' sharded
    flat parameters are summed over ``group`` (the shard group); replicated ones
    (NO_SHARD units, ignored parameters) are counted once.
    """
    norm_type = float(norm_type)
    sharded: list[torch.Tensor] = []
    replicated: list[torch.Tensor] = []
    seen: set[int] = set()
    for unit in units:
        if unit.handle is not None:
            # The parameters the optimizer sees: the flat one, or the originals (as PyTorch groups them).
            params = unit.handle.views.registered(unit.handle)
            target = sharded if unit.handle.is_sharded_over_ranks else replicated
            target += [p.grad for p in params if p.grad is not None]
            seen.update(id(p) for p in params)
    replicated += [p.grad for p in parameters if id(p) not in seen and p.grad is not None]
    if not sharded and not replicated:
        warnings.warn(f"Called FSDP.clip_grad_norm_() on rank {dist.get_rank()} with no gradients -- returning "
                      "the total norm in the default dtype", UserWarning, stacklevel=4)
    total = _total_norm(_norm(sharded, norm_type, device), _norm(replicated, norm_type, device), norm_type, group)
    coefficient = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    by_kind: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for grad in sharded + replicated:
        by_kind.setdefault((grad.device, grad.dtype), []).append(grad)
    for (grad_device, dtype), grads in by_kind.items():  # one cast of the coefficient and one kernel per kind
        torch._foreach_mul_(grads, coefficient.to(grad_device, dtype))
    return total


def _total_norm(sharded_norm: torch.Tensor, replicated_norm: torch.Tensor, norm_type: float,
                group: dist.ProcessGroup | None) -> torch.Tensor:
    """The global norm: the sharded part summed (max for inf) over ``group``, the replicated part added once."""
    if norm_type == math.inf:
        total = torch.maximum(sharded_norm, replicated_norm)
        if group is not None:
            collectives.all_reduce(total, group, where="clip_grad_norm_", op=dist.ReduceOp.MAX)
        return total
    total = sharded_norm ** norm_type
    if group is not None:
        collectives.all_reduce(total, group, where="clip_grad_norm_")
    return (total + replicated_norm ** norm_type) ** (1.0 / norm_type)


def _norm(grads: list[torch.Tensor], norm_type: float, device: torch.device) -> torch.Tensor:
    if not grads:
        return torch.zeros((), device=device)
    norms = torch.stack([torch.linalg.vector_norm(g.detach().float(), norm_type).to(device) for g in grads])
    return torch.linalg.vector_norm(norms, norm_type)
