"""``summon_full_params``: show every unit's full, full-precision parameters for a while."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

import tensorplay.distributed as dist

from .unit_state import TrainingState, UnitState


@contextlib.contextmanager
def summon_full_params(units: list[UnitState], writeback: bool, rank0_only: bool, offload_to_cpu: bool,
                       with_grads: bool) -> Iterator[None]:
    if rank0_only and writeback:
        raise ValueError("summon_full_params: rank0_only=True needs writeback=False (other ranks hold no full copy)")
    if with_grads and any(u.handle is not None and not u.handle.views.per_original() for u in units):
        raise ValueError("summon_full_params(with_grads=True) needs use_orig_params=True: with flat parameters "
                         "the original parameters have no .grad to show")
    busy = [u for u in units if u.handle is not None and u.ran_pre_backward]
    if busy:
        raise RuntimeError("summon_full_params cannot run during backward; call it before forward or after backward")
    with contextlib.ExitStack() as stack:
        for unit in units:
            stack.enter_context(_summon_unit(unit, writeback, rank0_only, offload_to_cpu, with_grads))
        yield


@contextlib.contextmanager
def _summon_unit(unit: UnitState, writeback: bool, rank0_only: bool, offload_to_cpu: bool,
                 with_grads: bool) -> Iterator[None]:
    handle = unit.handle
    if handle is None:
        yield
        return
    with torch.no_grad():
        full = handle.gather_full()
        grad = handle.flat_param.grad
        full_grad = handle.gather_full(grad) if with_grads and grad is not None else None
    shown = not rank0_only or dist.get_rank() == 0
    if shown:
        if offload_to_cpu:
            full = full.cpu()
        handle.views.expose_full(handle, handle.full_views(full))
        if full_grad is not None:
            handle.views.expose_full_grads(handle, handle.full_views(full_grad))
    previous, unit.training_state = unit.training_state, TrainingState.SUMMON_FULL_PARAMS
    try:
        yield
    finally:
        unit.training_state = previous
        if shown and writeback:
            handle.write_back(full)
        handle.views.expose_sharded(handle)
        if full_grad is not None:
            sharded_grad = handle.flat_param.grad
            assert sharded_grad is not None, "the flat gradient was cleared inside summon_full_params(with_grads=True)"
            handle.views.set_sharded_grad(handle, sharded_grad)
