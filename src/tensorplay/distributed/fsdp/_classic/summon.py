"""``summon_full_params``: show every unit's full, full-precision parameters for a while."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

import tensorplay.distributed as dist

from .unit_state import TrainingState, UnitState


class SummonArgumentError(ValueError, NotImplementedError):
    """A combination of ``summon_full_params`` arguments that cannot work (PyTorch raises NotImplementedError)."""


@contextlib.contextmanager
def summon_full_params(units: list[UnitState], writeback: bool, rank0_only: bool, offload_to_cpu: bool,
                       with_grads: bool) -> Iterator[None]:
    """Show each unit's full parameters (and, ``with_grads``, full gradients) until exit.

    The original parameters are registered ``nn.Parameter`` objects inside the
    context under both ``use_orig_params`` modes; ``writeback`` copies what was
    written to them (and to their gradients) back into this rank's shard at exit.
    Unlike PyTorch's, ``offload_to_cpu`` works without an accelerator, with
    NO_SHARD and with ``with_grads``.
    """
    if rank0_only and writeback:
        raise SummonArgumentError("summon_full_params: rank0_only=True needs writeback=False "
                                  "(other ranks hold no full copy)")
    if with_grads and any(u.handle is not None and not u.handle.views.per_original() for u in units):
        raise SummonArgumentError("summon_full_params(with_grads=True) needs use_orig_params=True: with flat "
                                  "parameters the original parameters have no .grad to show")
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
        sharded_grad = handle.views.sharded_grad(handle) if with_grads else None
        full_grad = handle.gather_full(sharded_grad) if sharded_grad is not None else None
    # rank0_only: rank 0 of the unit's process group (the shard group under the hybrid strategies, so one rank
    # per replica), as in PyTorch's FSDP
    group = unit.plan.process_group
    shown = not rank0_only or group is None or dist.get_rank(group) == 0
    if shown:
        if offload_to_cpu:
            full = full.cpu()
            full_grad = None if full_grad is None else full_grad.cpu()
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
            if sharded_grad is not None and full_grad is not None:
                with torch.no_grad():
                    sharded_grad.copy_(handle.own_chunk(full_grad))
        handle.views.expose_sharded(handle)
        if sharded_grad is not None:
            handle.views.set_sharded_grad(handle, sharded_grad)
