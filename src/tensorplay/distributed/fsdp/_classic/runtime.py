"""The forward/backward hooks of classic FSDP units.

Per unit and iteration the story is::

    pre_forward    gather (or wait for the prefetched gather), show the gathered views, cast inputs
    post_forward   free again if the plan reshards after forward; hook the outputs for backward
    pre_backward   (first gradient reaching an output) gather again; prefetch the next unit
    post_backward  (the unsharded gradient is complete) start its reduction; free the parameters
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
from dataclasses import dataclass, field
from enum import Enum, auto
from typing import TYPE_CHECKING, Any

import torch
from torch.utils._pytree import tree_flatten

from ..._shard.casting import cast_floating
from ..._shard.collectives import Pending
from ..api import BackwardPrefetch
from .plan_agreement import check_units_plan

if TYPE_CHECKING:
    from .fully_sharded_data_parallel import FullyShardedDataParallel as Unit


class TrainingState(Enum):
    """What a unit is doing (PyTorch's public ``training_state``): between forward and backward it is IDLE."""

    IDLE = auto()
    FORWARD_BACKWARD = auto()
    SUMMON_FULL_PARAMS = auto()


@dataclass
class RootState:
    """What the units of one wrapped model share, owned by the root."""

    units: list[Unit]                                          # every unit, root first
    forward_order: list[Unit] = field(default_factory=list)     # recorded on the first forward
    order_recorded: bool = False
    pending_reductions: list[Pending] = field(default_factory=list)
    end_of_backward_queued: bool = False

    def neighbour(self, unit: Unit, step: int) -> Unit | None:
        """The unit ``step`` places after ``unit`` in forward order, once the order is known."""
        if not self.order_recorded or unit not in self.forward_order:
            return None
        index = self.forward_order.index(unit) + step
        return self.forward_order[index] if 0 <= index < len(self.forward_order) else None


def lazy_init(unit: Unit, units: list[Unit]) -> None:
    """On the first forward of a model, make ``unit`` its root and link every unit to the root state."""
    if unit._root_state is not None:
        return
    check_units_plan(unit, units)  # before any collective: see [Note: plan agreement]
    state = RootState(units)
    for member in units:
        member._root_state, member._is_root = state, member is unit
    buffer_dtype = unit._precision.buffer_dtype if unit._precision is not None else None
    if buffer_dtype is not None:
        _cast_buffers(unit, buffer_dtype)


def _cast_buffers(root: Unit, dtype: torch.dtype) -> None:
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


def prefetch(unit: Unit | None) -> None:
    if unit is not None and unit._handle is not None:
        unit._handle.unshard(async_op=True)


def pre_forward(unit: Unit, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    if unit._ran_pre_backward:
        return _pre_recompute(unit, args, kwargs)
    state = unit._root_state
    assert state is not None
    if unit._is_root and not state.end_of_backward_queued:
        # A forward that had no backward (evaluation with grad enabled) may have left parameters
        # gathered; the optimizer may have stepped since, so gather afresh.
        for member in state.units:
            if member._handle is not None:
                member._handle.reshard()
    unit._training_state = TrainingState.FORWARD_BACKWARD
    if not state.order_recorded and unit not in state.forward_order:
        state.forward_order.append(unit)
    if unit._handle is not None:
        unit._handle.unshard()
        if unit._forward_prefetch:
            prefetch(state.neighbour(unit, +1))
        unit._handle.use_unsharded_views()
    return _cast_inputs(unit, args, kwargs)


def _pre_recompute(unit: Unit, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """A forward of a unit whose backward has begun: activation checkpointing recomputing it.

    See [Note: activation checkpointing].
    """
    if unit._handle is not None:
        unit._handle.unshard()
        unit._handle.use_unsharded_views()
    return _cast_inputs(unit, args, kwargs)


def _cast_inputs(unit: Unit, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    precision = unit._precision
    if precision is not None and (precision.cast_forward_inputs
                                  or (unit._is_root and precision.cast_root_forward_inputs)):
        args, kwargs = cast_floating(precision.param_dtype, (args, kwargs))
    return args, kwargs


def post_forward(unit: Unit, output: Any) -> Any:
    if unit._ran_pre_backward:  # a recomputation: the parameters stay gathered for the rest of backward
        return output
    unit._training_state = TrainingState.IDLE
    handle = unit._handle
    grad_enabled = torch.is_grad_enabled()
    # The root's parameters are needed first in backward, so it keeps them.
    if handle is not None and (not grad_enabled or (handle.plan.reshard_after_forward and not unit._is_root)):
        handle.reshard()
    if grad_enabled:
        unit._ran_pre_backward = False
        for tensor in tree_flatten(output)[0]:
            if isinstance(tensor, torch.Tensor) and tensor.requires_grad:
                tensor.register_hook(lambda grad, unit=unit: pre_backward(unit))
    if unit._is_root:
        assert unit._root_state is not None
        unit._root_state.order_recorded = True
    return output


def pre_backward(unit: Unit) -> None:
    if unit._ran_pre_backward:
        return
    unit._ran_pre_backward = True
    unit._training_state = TrainingState.FORWARD_BACKWARD
    state = unit._root_state
    assert state is not None
    if not state.end_of_backward_queued:
        state.end_of_backward_queued = True
        torch.autograd.Variable._execution_engine.queue_callback(lambda: end_of_backward(state))
    if unit._handle is not None:
        unit._handle.unshard()
        unit._handle.use_unsharded_views()  # what a recomputing forward reads (activation checkpointing)
        if unit._backward_prefetch is BackwardPrefetch.BACKWARD_PRE:
            prefetch(state.neighbour(unit, -1))


def post_backward(unit: Unit) -> None:
    """The unit's unsharded gradient is complete: reduce it (unless in ``no_sync``) and free the parameters."""
    handle, state = unit._handle, unit._root_state
    assert handle is not None and state is not None
    if unit._sync_gradients:
        grad = handle.take_unsharded_grad()
        assert grad is not None  # on_grad_ready fires once the gradient exists
        state.pending_reductions.append(handle.reduce_grad(grad))
    # Under no_sync the unsharded gradient stays on the handle and keeps accumulating.
    handle.reshard()
    if unit._backward_prefetch is BackwardPrefetch.BACKWARD_POST:
        prefetch(state.neighbour(unit, -1))


def end_of_backward(state: RootState) -> None:
    for pending in state.pending_reductions:
        pending.wait()
    state.pending_reductions.clear()
    for unit in state.units:
        if unit._handle is not None:
            unit._handle.reshard()
        unit._ran_pre_backward = False
        unit._training_state = TrainingState.IDLE
    state.end_of_backward_queued = False
