"""The forward/backward hooks of classic FSDP units.

Per unit and iteration the story is::

    pre_forward    gather (or wait for the prefetched gather), show the gathered views, cast inputs
    post_forward   free again if the plan reshards after forward; hook the outputs for backward
    pre_backward   (first gradient reaching an output) gather again; prefetch the next unit
    post_backward  (the unsharded gradient is complete) start its reduction (NO_SHARD: in buckets of
                   units, see [Note: bucketed NO_SHARD reduction]); free the parameters
    end of backward (root, once) finish every reduction, free what is still gathered

Units reach each other through the root's :class:`RootState`, created on the first forward.

[Note: activation checkpointing] A checkpointed region recomputes its forward
during backward, reading the modules' parameters again. So pre_backward shows the
gathered views (not only gathers), and a unit's forward that runs after its
pre_backward (the checkpoint wraps the unit) only makes sure the views are
gathered and shown: it neither records order, nor frees anything, nor hooks the
recomputed outputs, which autograd discards. A region's recomputation may also
run the forward of units whose backward has not begun; those reshard as usual
and the saved views see the data again when pre_backward re-gathers into the
same storage (see [Note: re-gathering before backward] in ``flat_param``).
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten

from ..._not_traced import not_traced
from ..._sharding.casting import cast_floating
from ..api import BackwardPrefetch
from .grad_buckets import GradBuckets
from .placement import Precision
from .plan_agreement import check_units_plan
from .unit_state import RootState, TrainingState, UnitState


def lazy_init(unit: UnitState, root_module: nn.Module, units: list[tuple[str, UnitState]]) -> None:
    """On the first forward of a model, make ``unit`` (``root_module``'s) its root and link every unit to it.

    ``units``: every unit of the model with its FQN, ``unit`` first.
    """
    if unit.root is not None:
        return
    check_units_plan(unit.name, units)  # before any collective: see [Note: plan agreement]
    root = RootState([member for _, member in units])
    for member in root.units:
        member.root, member.is_root = root, member is unit
    if unit.precision.buffer_dtype is not None:
        _cast_buffers(root_module, unit.precision.buffer_dtype)


def take_full_dtype(unit: UnitState) -> bool:
    """Before the model's first forward, the unit's dtypes follow its flat parameter's new dtype (accelerate's
    upcast), as PyTorch's lazy init makes them: what ``MixedPrecision`` leaves unset falls back to it."""
    if unit.root is not None or unit.handle is None:
        return False
    unit.precision = Precision.resolve(unit.options.mixed_precision, unit.handle.flat_param.dtype)
    unit.handle.take_precision(unit.precision)
    return True


def _cast_buffers(root: nn.Module, dtype: torch.dtype) -> None:
    """Cast floating-point buffers to ``dtype``; state dicts still show them in their original dtype."""
    for module in root.modules():
        original = {name: buffer.dtype for name, buffer in module._buffers.items()
                    if buffer is not None and buffer.is_floating_point() and buffer.dtype != dtype}
        if not original:
            continue
        for name in original:
            buffer = module._buffers[name]
            assert buffer is not None  # ``original`` holds only present buffers
            module._buffers[name] = buffer.to(dtype)
        module._register_state_dict_hook(functools.partial(_restore_buffer_dtypes, original=original))


def _restore_buffer_dtypes(module: torch.nn.Module, state_dict: dict[str, Any], prefix: str, local_metadata: Any,
                           original: dict[str, torch.dtype]) -> None:
    for name, dtype in original.items():
        if prefix + name in state_dict:
            state_dict[prefix + name] = state_dict[prefix + name].to(dtype)


def prefetch(unit: UnitState | None) -> None:
    if unit is not None and unit.handle is not None:
        unit.handle.unshard(async_op=True)


def pre_forward(unit: UnitState, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    if unit.ran_pre_backward:
        return _pre_recompute(unit, args, kwargs)
    root = unit.root
    assert root is not None
    if unit.is_root and not root.end_of_backward_queued:
        # A forward that had no backward (evaluation with grad enabled) may have left parameters
        # gathered; the optimizer may have stepped since, so gather afresh.
        for member in root.units:
            if member.handle is not None:
                member.handle.reshard()
    unit.training_state = TrainingState.FORWARD_BACKWARD
    if not root.order_recorded and unit not in root.forward_order:
        root.forward_order.append(unit)
    if unit.handle is not None:
        # zero_grad(set_to_none=True) (or an in-backward step) cleared the original parameters' gradients:
        # drop the flat gradient shard they were views of, as PyTorch does here, rather than at the next reduction.
        unit.handle.release_stale_grad()
        unit.handle.unshard()
        if unit.options.forward_prefetch:
            prefetch(root.neighbour(unit, +1))
        unit.handle.use_unsharded_views()
    return _cast_inputs(unit, args, kwargs)


def _pre_recompute(unit: UnitState, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """A forward of a unit whose backward has begun: activation checkpointing recomputing it.

    See [Note: activation checkpointing].
    """
    if unit.handle is not None:
        unit.handle.unshard()
        unit.handle.use_unsharded_views()
    return _cast_inputs(unit, args, kwargs)


def _cast_inputs(unit: UnitState, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    precision = unit.precision
    if precision.cast_forward_inputs or (unit.is_root and precision.cast_root_forward_inputs):
        args, kwargs = cast_floating(precision.param_dtype, (args, kwargs))
    return args, kwargs


@not_traced
def post_forward(unit: UnitState, output: Any) -> Any:
    if unit.ran_pre_backward:  # a recomputation: the parameters stay gathered for the rest of backward
        return output
    unit.training_state = TrainingState.IDLE
    handle = unit.handle
    grad_enabled = torch.is_grad_enabled()
    # The root's parameters are needed first in backward, so it keeps them.
    if handle is not None and (not grad_enabled or (handle.plan.reshard_after_forward and not unit.is_root)):
        handle.reshard()
    if grad_enabled:
        unit.ran_pre_backward = False
        for tensor in tree_flatten(output)[0]:
            if isinstance(tensor, torch.Tensor) and tensor.requires_grad:
                tensor.register_hook(lambda grad, unit=unit: pre_backward(unit))
    if unit.is_root:
        assert unit.root is not None
        unit.root.order_recorded = True
    return output


def pre_backward(unit: UnitState) -> None:
    if unit.ran_pre_backward:
        return
    unit.ran_pre_backward = True
    unit.training_state = TrainingState.FORWARD_BACKWARD
    root = unit.root
    assert root is not None
    if not root.end_of_backward_queued:
        root.end_of_backward_queued = True
        torch.autograd.Variable._execution_engine.queue_callback(lambda: end_of_backward(root))
    if unit.handle is not None:
        unit.handle.unshard()
        unit.handle.use_unsharded_views()  # what a recomputing forward reads (activation checkpointing)
        if unit.options.backward_prefetch is BackwardPrefetch.BACKWARD_PRE:
            prefetch(root.neighbour(unit, -1))


def post_backward(unit: UnitState) -> None:
    """The unit's unsharded gradient is complete: reduce it (unless in ``no_sync``) and free the parameters."""
    handle, root = unit.handle, unit.root
    assert handle is not None and root is not None
    if unit.sync_gradients:
        grad = handle.take_unsharded_grad()
        assert grad is not None  # on_grad_ready fires once the gradient exists
        if root.pending_reductions:  # the previous unit's cross-replica stage (HYBRID) starts now
            root.pending_reductions[-1].advance()
        reduction = _grad_buckets(root).add(handle, grad)
        if reduction is not None:  # None: the gradient waits in its bucket
            root.pending_reductions.append(reduction)
    # Under no_sync the unsharded gradient stays on the handle and keeps accumulating.
    handle.reshard()
    if unit.options.backward_prefetch is BackwardPrefetch.BACKWARD_POST:
        prefetch(root.neighbour(unit, -1))


def grad_target(unit: UnitState) -> tuple[torch.Tensor, float] | None:
    """Where backward may write ``unit``'s gradient in place, and divided by what: its bucket slot (NO_SHARD)."""
    root = unit.root
    if root is None or unit.handle is None or not unit.sync_gradients:
        return None
    return _grad_buckets(root).target(unit.handle)


def _grad_buckets(root: RootState) -> GradBuckets:
    """The buckets for NO_SHARD gradients, planned at the first gradient and kept while the plan holds."""
    if root.grad_buckets is None or not root.grad_buckets_checked:
        handles = [unit.handle for unit in reversed(root.forward_order)
                   if unit.handle is not None and unit.sync_gradients]
        if root.grad_buckets is None or root.grad_buckets.signature != GradBuckets.signature_of(handles):
            root.grad_buckets = GradBuckets(handles)
        root.grad_buckets_checked = True
    return root.grad_buckets


def end_of_backward(root: RootState) -> None:
    if root.grad_buckets is not None:
        root.pending_reductions.extend(root.grad_buckets.flush())
    for pending in root.pending_reductions:
        pending.wait()
    root.pending_reductions.clear()
    if root.grad_buckets is not None:
        root.grad_buckets.end_iteration()  # the plan and its buffers stay for the next iteration
    root.grad_buckets_checked = False
    for unit in root.units:
        if unit.handle is not None:
            unit.handle.reshard()
        unit.ran_pre_backward = False
        unit.training_state = TrainingState.IDLE
    root.end_of_backward_queued = False
