"""Elementwise operations over aligned tensor lists, and the grouping that feeds them.

The optimizer updates in ``_updates`` are written once against :class:`ListOps`;
``foreach`` picks between one multi-tensor kernel per operation (over a
(device, dtype) group) and one per-tensor kernel per element (one parameter at a
time, see :func:`groups`).

[Note: CPU batches] On the CPU a ``torch._foreach_*`` kernel is a loop over the
same per-tensor kernels, so it gives bitwise the per-tensor results while
paying Python's call overhead once per list instead of once per tensor. A
per-tensor step of CPU parameters (:meth:`ListOps.for_step`) therefore runs
each batch of small parameters (at most :data:`CPU_BATCH_NUMEL` elements in
all, a larger parameter alone) through foreach kernels: the arithmetic and its
order stay those of the per-tensor path, and peak memory stays at one batch's
temporaries.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch
from torch import Tensor

__all__ = ["CPU_BATCH_NUMEL", "ListOps", "Scalars", "groups"]

Scalars = float | Sequence[float]
_CPU_ONE = torch.tensor(1.0)
#: Most elements in one batch of a per-tensor CPU step (Note: CPU batches), a larger parameter alone.
CPU_BATCH_NUMEL = 1 << 16


class ListOps:
    """Elementwise operations over aligned tensor lists.

    With ``foreach`` each call is one ``torch._foreach_*`` kernel; without, one
    per-tensor kernel per element. A ``Scalars`` argument is either one number
    for every element or one number per element.
    """

    def __init__(self, foreach: bool, cpu_batches: bool = False) -> None:
        self._grouping = foreach
        self._cpu_batches = cpu_batches
        #: Whether each operation is one foreach kernel (per group, or per CPU batch).
        self.foreach = foreach or cpu_batches

    @classmethod
    def for_step(cls, foreach: bool, params: list[Tensor], grads: list[Tensor]) -> ListOps:
        """The operations of one step; a per-tensor step of dense CPU tensors runs in batches."""
        batches = not foreach and all(p.is_cpu for p in params) and not any(g.is_sparse for g in grads)
        return cls(foreach, cpu_batches=batches)

    def groups(self, params: list[Tensor], *lists: list, real: bool = True
               ) -> Iterator[tuple[list[int], list[list]]]:
        """:func:`groups` for these operations' ``foreach`` (and CPU batches)."""
        return groups(self._grouping, params, *lists, real=real, cpu_batches=self._cpu_batches)

    def neg(self, xs: list[Tensor]) -> list[Tensor]:
        return list(torch._foreach_neg(xs)) if self.foreach else [x.neg() for x in xs]

    def add(self, xs: list[Tensor], ys: list[Tensor], alpha: float) -> list[Tensor]:
        if self.foreach:
            return list(torch._foreach_add(xs, ys, alpha=alpha))
        return [x.add(y, alpha=alpha) for x, y in zip(xs, ys, strict=True)]

    def add_(self, xs: list[Tensor], ys: list[Tensor], alpha: float) -> None:
        if self.foreach:
            torch._foreach_add_(xs, ys, alpha=alpha)
        else:
            for x, y in zip(xs, ys, strict=True):
                x.add_(y, alpha=alpha)

    def add_scalar_(self, xs: list[Tensor], scalar: float) -> None:
        if self.foreach:
            torch._foreach_add_(xs, scalar)
        else:
            for x in xs:
                x.add_(scalar)

    def add_scalar(self, xs: list[Tensor], scalar: float) -> list[Tensor]:
        return list(torch._foreach_add(xs, scalar)) if self.foreach else [x.add(scalar) for x in xs]

    def increment_(self, steps: list[Tensor]) -> None:
        if not self.foreach:
            for step in steps:
                step += 1
        elif steps[0].is_cpu:
            # A CPU tensor operand keeps foreach from wrapping the 1 anew per element.
            torch._foreach_add_(steps, _CPU_ONE, alpha=1.0)
        else:
            torch._foreach_add_(steps, 1)

    def mul_(self, xs: list[Tensor], factor: Scalars | list[Tensor]) -> None:
        if self.foreach:
            torch._foreach_mul_(xs, factor)
        else:
            for x, f in zip(xs, _per_element(factor, len(xs)), strict=True):
                x.mul_(f)

    def mul(self, xs: list[Tensor], factor: Scalars | list[Tensor]) -> list[Tensor]:
        if self.foreach:
            return list(torch._foreach_mul(xs, factor))
        return [x.mul(f) for x, f in zip(xs, _per_element(factor, len(xs)), strict=True)]

    def div_(self, xs: list[Tensor], divisor: Scalars | list[Tensor]) -> None:
        if self.foreach:
            torch._foreach_div_(xs, divisor)
        else:
            for x, d in zip(xs, _per_element(divisor, len(xs)), strict=True):
                x.div_(d)

    def lerp_(self, xs: list[Tensor], ends: list[Tensor], weight: float) -> None:
        if self.foreach:
            torch._foreach_lerp_(xs, ends, weight)
        else:
            for x, end in zip(xs, ends, strict=True):
                x.lerp_(end, weight)

    def addcmul_(self, xs: list[Tensor], ys: list[Tensor], zs: list[Tensor], value: float) -> None:
        if self.foreach:
            torch._foreach_addcmul_(xs, ys, zs, value=value)
        else:
            for x, y, z in zip(xs, ys, zs, strict=True):
                x.addcmul_(y, z, value=value)

    def addcmul(self, xs: list[Tensor], ys: list[Tensor], zs: list[Tensor], value: float) -> list[Tensor]:
        if self.foreach:
            return list(torch._foreach_addcmul(xs, ys, zs, value=value))
        return [x.addcmul(y, z, value=value) for x, y, z in zip(xs, ys, zs, strict=True)]

    def addcdiv_(self, xs: list[Tensor], ys: list[Tensor], zs: list[Tensor], value: Scalars = 1.0) -> None:
        if self.foreach:
            torch._foreach_addcdiv_(xs, ys, zs, value)
        else:
            for x, y, z, v in zip(xs, ys, zs, _per_element(value, len(xs)), strict=True):
                x.addcdiv_(y, z, value=v)

    def sqrt(self, xs: list[Tensor]) -> list[Tensor]:
        return list(torch._foreach_sqrt(xs)) if self.foreach else [x.sqrt() for x in xs]

    def sqrt_(self, xs: list[Tensor]) -> None:
        if self.foreach:
            torch._foreach_sqrt_(xs)
        else:
            for x in xs:
                x.sqrt_()

    def maximum_(self, xs: list[Tensor], ys: list[Tensor]) -> None:
        if self.foreach:
            torch._foreach_maximum_(xs, ys)
        else:
            for x, y in zip(xs, ys, strict=True):
                torch.maximum(x, y, out=x)

    def copy_(self, xs: list[Tensor], sources: list[Tensor]) -> None:
        if self.foreach:
            torch._foreach_copy_(xs, sources)
        else:
            for x, src in zip(xs, sources, strict=True):
                x.copy_(src)

    def abs(self, xs: list[Tensor]) -> list[Tensor]:
        return list(torch._foreach_abs(xs)) if self.foreach else [x.abs() for x in xs]


def _per_element(value: Scalars | list[Tensor], n: int) -> Sequence:
    return value if isinstance(value, (list, tuple)) else [value] * n


def _as_real(t: Tensor | None) -> Tensor | None:
    if t is not None and t.is_complex() and not t.is_sparse:
        return torch.view_as_real(t)
    return t


def groups(foreach: bool, params: list[Tensor], *lists: list, real: bool = True, cpu_batches: bool = False
           ) -> Iterator[tuple[list[int], list[list]]]:
    """Yield (indices, the lists sliced to them) for each set of parameters stepped together.

    With ``foreach`` a set is every parameter of one (device, dtype); without, one
    parameter, or with ``cpu_batches`` one batch (Note: CPU batches). An empty list
    (an unused state, e.g. ``max_exp_avg_sqs`` without amsgrad) slices to an empty
    list. ``real`` views complex tensors as real.
    """
    if foreach:
        index_sets = _by_device_dtype(params)
    elif cpu_batches:
        index_sets = _cpu_batches(params)
    else:
        index_sets = [[i] for i in range(len(params))]
    if real and any(p.is_complex() for p in params):
        for indices in index_sets:
            yield indices, [[_as_real(lst[i]) for i in indices] if lst else [] for lst in (params, *lists)]
        return
    for indices in index_sets:
        yield indices, [[lst[i] for i in indices] if lst else [] for lst in (params, *lists)]


def _by_device_dtype(params: list[Tensor]) -> list[list[int]]:
    buckets: dict[tuple[torch.device, torch.dtype], list[int]] = {}
    for i, p in enumerate(params):
        buckets.setdefault((p.device, p.dtype), []).append(i)
    return list(buckets.values())


def _cpu_batches(params: list[Tensor]) -> list[list[int]]:
    """Indices of (CPU) ``params`` in batches of one dtype and at most CPU_BATCH_NUMEL elements
    (a larger parameter alone), in order within each dtype."""
    batches: list[list[int]] = []
    open_batches: dict[torch.dtype, tuple[list[int], int]] = {}
    for i, p in enumerate(params):
        size = p.numel()
        batch, numel = open_batches.get(p.dtype, (None, 0))
        if batch is None or numel + size > CPU_BATCH_NUMEL:
            batch, numel = [], 0
            batches.append(batch)
        batch.append(i)
        open_batches[p.dtype] = batch, numel + size
    return batches
