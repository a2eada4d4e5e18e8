"""The global gradient norm of in-backward parameters, sharded or not, and the clip coefficient.

A gradient is one of: a plain tensor, the same on every rank (single process,
DDP), or a DTensor (fully_shard): its local tensor holds this rank's part on
the mesh dimensions where it is ``Shard``, and a copy on those where it is
``Replicate``. The p-th powers of the local norms are summed here, then summed
over the ``Shard`` dimensions' groups (one small all-reduce each; the max for
the inf-norm), so every rank gets the same norm.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import torch
from torch import Tensor
from torch.distributed.tensor import DTensor

import tensorplay.distributed as dist
from tensorplay.distributed._comm import collectives

__all__ = ["NormPart", "clip_coefficient", "local_norm_part"]

#: Added to the norm before dividing, as ``torch.nn.utils.clip_grad_norm_`` does.
_EPS = 1e-6


class NormPart:
    """This rank's share of a global norm: the local norm of each gradient seen, and the groups to reduce over.

    The local total is the norm of the per-gradient norms, as ``clip_grad_norm_``
    computes it, so a single process matches it bitwise.
    """

    __slots__ = ("groups", "norm_type", "norms")

    def __init__(self, norm_type: float) -> None:
        self.norm_type = norm_type
        self.norms: list[Tensor] = []
        self.groups: list[Any] | None = None  # None until a gradient is seen

    def add(self, grad: Tensor, shard_groups: tuple[object, ...] = ()) -> None:
        """Fold ``grad`` (this rank's part of it) in; ``shard_groups``: the groups a plain tensor is sharded
        over (classic FSDP's flat shards; a DTensor says its own)."""
        local, groups = _local_and_groups(grad, shard_groups)
        if self.groups is None:
            self.groups = groups
        elif not _same_groups(self.groups, groups):
            raise ValueError("apply_optimizer_in_backward: clipping needs every parameter of one call sharded over "
                             "the same mesh dimensions; split the parameters into one call per mesh")
        self.norms.append(torch.linalg.vector_norm(local.detach(), self.norm_type))

    def total(self) -> Tensor | None:
        """The global norm on every rank (a collective over the shard groups), or None without gradients."""
        if not self.norms:
            return None
        local = torch.linalg.vector_norm(torch.stack(self.norms), self.norm_type)
        if not self.groups:
            return local
        inf = self.norm_type == math.inf
        value = local.clone() if inf else local.pow(self.norm_type)
        for group in self.groups:
            collectives.all_reduce(value, group, where="apply_optimizer_in_backward clipping",
                                   op=dist.ReduceOp.MAX if inf else dist.ReduceOp.SUM)
        return value if inf else value.pow(1.0 / self.norm_type)


def local_norm_part(grads: Iterable[tuple[Tensor, tuple[object, ...]]], norm_type: float) -> NormPart:
    """The norm part of (gradient, shard groups) pairs."""
    part = NormPart(norm_type)
    for grad, groups in grads:
        part.add(grad, groups)
    return part


def clip_coefficient(norm: Tensor, max_norm: float) -> Tensor:
    """``min(1, max_norm / (norm + eps))``: the factor the gradients are multiplied by."""
    return torch.clamp(max_norm / (norm + _EPS), max=1.0)


def _same_groups(ours: list[Any], theirs: list[Any]) -> bool:
    """Whether two lists of shard groups reduce over the same ranks: the same groups by name, or (two meshes made
    apart over the same ranks) the same ranks, looked up only then."""
    if len(ours) != len(theirs):
        return False
    for a, b in zip(ours, theirs, strict=True):
        if a is b or getattr(a, "group_name", None) == getattr(b, "group_name", object()):
            continue
        if dist.get_process_group_ranks(a) != dist.get_process_group_ranks(b):
            return False
    return True


def _local_and_groups(grad: Tensor, shard_groups: tuple[object, ...]) -> tuple[Tensor, list[Any]]:
    if not isinstance(grad, DTensor):
        return grad, list(shard_groups)
    mesh = grad.device_mesh
    groups = [mesh.get_group(dim) for dim, placement in enumerate(grad.placements) if placement.is_shard()]
    return grad.to_local(), groups
