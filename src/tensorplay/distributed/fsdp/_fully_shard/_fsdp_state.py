"""FSDPState: the module hooks of one fully_shard call, and the root's per-iteration bookkeeping."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.autograd import Variable
from torch.utils._pytree import tree_map

from tensorplay.distributed._not_traced import not_traced
from tensorplay.distributed._sharding.casting import cast_floating
from tensorplay.distributed._sharding.storage import BufferPool

from ._fsdp_api import MixedPrecisionPolicy
from ._fsdp_common import TrainingState
from ._fsdp_param_group import FSDPParamGroup, GradReduction
from ._fsdp_plan_agreement import check_tree_plan
from ._fsdp_shared_params import check_shared_across_groups


@dataclass
class IterationContext:
    """Shared by every state under one root: what happened in this step so far."""

    states: list[FSDPState] = field(default_factory=list)
    forward_order: list[FSDPState] = field(default_factory=list)
    last_forward_order: list[FSDPState] = field(default_factory=list)
    #: Each state's position in :attr:`forward_order` / :attr:`last_forward_order`: prefetch targets are found
    #: in O(1) per module, not by a search of the order (quadratic in the number of modules per step).
    forward_index: dict[FSDPState, int] = field(default_factory=dict)
    last_forward_index: dict[FSDPState, int] = field(default_factory=dict)
    pending_reduces: list[GradReduction] = field(default_factory=list)  # oldest first, reduce-scatter in flight
    scattered: list[GradReduction] = field(default_factory=list)  # reduce-scatter done, HSDP all-reduce in flight
    callback_queued: bool = False
    is_last_backward: bool = True
    post_optim_event: Any = None
    buffers: BufferPool = field(default_factory=BufferPool)  # collective scratch shared by the root's groups

    @property
    def all_states(self) -> list[FSDPState]:
        """PyTorch's name for :attr:`states`."""
        return self.states

    def record_forward(self, state: FSDPState) -> None:
        """Note that ``state`` ran forward in this step (once: a recompute or a list group's later module is not)."""
        if state not in self.forward_index:
            self.forward_index[state] = len(self.forward_order)
            self.forward_order.append(state)

    def new_forward(self) -> None:
        """A step begins: this step's order becomes the last one (kept when no state ran forward yet)."""
        if self.forward_order:
            self.last_forward_order, self.forward_order = self.forward_order, []
            self.last_forward_index, self.forward_index = self.forward_index, {}

    def forget_forward(self) -> None:
        self.forward_order, self.forward_index = [], {}

    def next_in_last_forward(self, state: FSDPState) -> list[FSDPState]:
        """The state after ``state`` in the last step's forward order (none if last or absent)."""
        return _neighbour(self.last_forward_order, self.last_forward_index, state, 1)

    def next_in_backward(self, state: FSDPState) -> list[FSDPState]:
        """The state before ``state`` in this step's forward order: the next one to run backward."""
        return _neighbour(self.forward_order, self.forward_index, state, -1)

    def bound_reduces(self, keep: int) -> None:
        """Finish the oldest reduce-scatters in flight until at most ``keep`` remain (their all-reduces may run on)."""
        while len(self.pending_reduces) > keep:
            reduction = self.pending_reduces.pop(0)
            reduction.advance()
            self.scattered.append(reduction)

    def wait_reduce(self) -> None:
        """Finish every reduction in flight, oldest first, and hand their gradients out."""
        for reduction in (*self.scattered, *self.pending_reduces):
            reduction.wait()
        self.scattered.clear()
        self.pending_reduces.clear()


class FSDPState:
    """Hooks for the modules of one ``fully_shard`` call.

    The first state whose forward runs becomes the root: it lazily finds every
    state below it, shares one :class:`IterationContext` with them and, in
    backward, queues the callback that finishes the step.
    """

    modules: tuple[nn.Module, ...]
    group: FSDPParamGroup | None
    mp_policy: MixedPrecisionPolicy
    auto_reshard_after_forward: bool
    ignored_params: frozenset[nn.Parameter]
    is_root: bool | None
    ctx: IterationContext
    forward_prefetch: list[FSDPState] | None
    backward_prefetch: list[FSDPState] | None

    def __init__(self, modules: tuple[nn.Module, ...], mp_policy: MixedPrecisionPolicy,
                 auto_reshard_after_forward: bool, ignored_params: frozenset[nn.Parameter] = frozenset()) -> None:
        self.modules, self.mp_policy = modules, mp_policy
        self.auto_reshard_after_forward = auto_reshard_after_forward
        self.ignored_params = ignored_params
        self.group, self.is_root, self.ctx = None, None, IterationContext()
        self.forward_prefetch, self.backward_prefetch = None, None
        self._modules_run: set[int] = set()
        for module in modules:
            module.register_forward_pre_hook(self._pre_forward_hook, prepend=True, with_kwargs=True)
            module.register_forward_hook(self._post_forward_hook, prepend=False)

    def attach(self, group: FSDPParamGroup | None) -> None:
        self.group = group
        if group is not None:
            group.on_post_backward = self._post_backward

    # ---- lazy init --------------------------------------------------------------------------------
    def reset_root(self) -> None:
        """Forget a root decided by an earlier forward: a parent was sharded since (``fully_shard`` on it)."""
        if self.is_root and self.auto_reshard_after_forward and self.group is not None:
            self.group.reshard_after_forward = True
        self.is_root, self.ctx = None, IterationContext()
        if self.group is not None:
            self.group.reshard()  # ``parameters()`` must list the sharded parameters again

    def _lazy_init(self) -> None:
        if self.is_root is not None:
            return
        if len(self.modules) > 1:
            names = ", ".join(type(m).__name__ for m in self.modules)
            raise RuntimeError(f"FSDP requires a single root module but got {self.modules}: the modules of one "
                               f"fully_shard([...]) call ({names}) ran forward with no fully_shard parent; "
                               f"call fully_shard on their common parent too")
        root = self.modules[0]
        nested = [(name, sub.__dict__["_fsdp_state"]) for name, sub in root.named_modules()
                  if sub.__dict__.get("_fsdp_state") not in (None, self)]
        for name, state in nested:
            if state.is_root is not None:
                raise RuntimeError(
                    f"FSDP state has already been lazily initialized for {name}\nFSDP requires running forward "
                    f"through the root module first ({type(root).__name__}): '{name}' ran forward on its own "
                    f"after its parent was sharded")
        ignored = self.ignored_params.union(*(state.ignored_params for _, state in nested))
        check_shared_across_groups(self.modules, ignored, final=True)  # [Note: naming a parameter shared across groups]
        check_tree_plan(self.modules)  # before any collective: see [Note: plan agreement]
        self.is_root = True
        ctx = IterationContext(states=[self])
        for _, state in nested:
            if state not in ctx.states:
                state.is_root, state.ctx = False, ctx
                ctx.states.append(state)
        self.ctx = ctx
        _init_fqns(root, ctx.states)
        for state in ctx.states:
            if state.group is not None:
                state.group.buffers = ctx.buffers
                state.group.adopt_replaced_params()  # e.g. re-initialized after fully_shard
        if self.auto_reshard_after_forward and self.group is not None:
            self.group.reshard_after_forward = False  # needed first in backward anyway

    # ---- PyTorch's private names, for code and tests written against PyTorch's fully_shard -------
    @property
    def _is_root(self) -> bool | None:
        return self.is_root

    @property
    def _fsdp_param_group(self) -> FSDPParamGroup | None:
        return self.group

    @property
    def _state_ctx(self) -> IterationContext:
        return self.ctx

    @property
    def _fsdp_param_groups(self) -> list[_ReducedThroughState]:
        """What pipelining calls ``post_backward()`` on: the group, its reduction kept by this state."""
        return [_ReducedThroughState(self)] if self.group is not None else []

    def _root_post_backward_final_callback(self) -> None:
        self._root_final_callback()

    # ---- forward ----------------------------------------------------------------------------------
    def _pre_forward_hook(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        return self.pre_forward(module, args, kwargs)

    def _post_forward_hook(self, module: nn.Module, args: tuple, output: Any) -> Any:
        return self.post_forward(module, output)

    @not_traced
    def pre_forward(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        self._lazy_init()
        if self.is_root and not _in_backward():  # not an activation-checkpoint recompute
            self._begin_iteration()
        if self.mp_policy.param_dtype is not None and self.mp_policy.cast_forward_inputs:
            args, kwargs = cast_floating(self.mp_policy.param_dtype, (args, kwargs))
        if self.group is None:
            return args, kwargs
        self.ctx.record_forward(self)
        # The next group's all-gather is issued once ours has arrived, before ours is copied out.
        self.group.unshard(async_op=True)
        self.group.wait_for_transfer()
        for target in self._forward_targets():
            if target.group is not None:
                target.group.unshard(async_op=True)
        return self.group.pre_forward(args, kwargs)

    @not_traced
    def post_forward(self, module: nn.Module, output: Any) -> Any:
        if self.group is not None:
            self._modules_run.add(id(module))
            if len(self._modules_run) == len(self.modules):  # a list group reshards after its last module
                self._modules_run.clear()
                self.group.post_forward()
        if self.mp_policy.output_dtype is not None:
            output = cast_floating(self.mp_policy.output_dtype, output)
        return _register_pre_backward(self, output)

    def _begin_iteration(self) -> None:
        ctx = self.ctx
        if ctx.callback_queued:
            self.reset_iter_state()  # the last backward raised before its final callback ran
        ctx.new_forward()
        if ctx.post_optim_event is not None:
            ctx.post_optim_event.wait()  # all-gathers must see the optimizer's update
            ctx.post_optim_event = None

    def _forward_targets(self) -> list[FSDPState]:
        if self.forward_prefetch is not None:
            return self.forward_prefetch
        if _in_backward():  # a recompute: the next group in forward order has finished its backward
            return []
        return self.ctx.next_in_last_forward(self)

    def reset_iter_state(self) -> None:
        """Forget a step that raised: in-flight collectives are finished and discarded, groups resharded."""
        ctx = self.ctx
        for reduction in (*ctx.scattered, *ctx.pending_reduces):
            reduction.discard()  # every rank issued it; its gradients are dropped
        ctx.scattered.clear()
        ctx.pending_reduces.clear()
        ctx.callback_queued = False
        ctx.forget_forward()
        for state in ctx.states or [self]:
            state._modules_run.clear()
            if state.group is not None:
                state.group.reset_iter_state()

    # ---- backward ---------------------------------------------------------------------------------
    def pre_backward(self) -> None:
        ctx = self.ctx
        if not ctx.callback_queued:
            ctx.callback_queued = True
            Variable._execution_engine.queue_callback(self._root_final_callback)
        group = self.group
        if group is None:
            return
        first_time = group.training_state not in (TrainingState.PRE_BACKWARD, TrainingState.POST_BACKWARD)
        if group.unshard_in_backward:
            group.unshard(async_op=True)  # usually prefetched: returns at once
            if first_time:  # as in forward: prefetch before our copy-out
                group.wait_for_transfer()
        if first_time:
            self._prefetch_for_backward()
        group.pre_backward()

    def _prefetch_for_backward(self) -> None:
        targets = self.backward_prefetch
        if targets is None:
            targets = self.ctx.next_in_backward(self)
        for target in targets:
            group_ = target.group
            if group_ is not None and group_.training_state == TrainingState.IDLE and group_.unshard_in_backward:
                group_.unshard(async_op=True)

    def _post_backward(self) -> None:
        group = self.group
        assert group is not None  # installed only on a state with a group
        reduction = group.post_backward()
        if reduction is not None:
            # Bounding the reduce-scatters in flight bounds the input buffers kept (one by default).
            self.ctx.bound_reduces(keep=group.max_input_buffers - 1)
            self.ctx.pending_reduces.append(reduction)

    def _root_final_callback(self) -> None:
        ctx = self.ctx
        order = list(reversed(ctx.forward_order)) + [s for s in ctx.states if s not in ctx.forward_index]
        for state in order:
            group = state.group
            if group is None:
                continue
            has_grads = any(p.unsharded_grad is not None for p in group.fsdp_params)
            # Not yet reduced: no post-backward node fired (inputs without grad), or a list group's
            # earlier module produced gradients after it fired.
            if has_grads and (not group.post_backward_done or group.requires_gradient_sync):
                state._post_backward()
        if ctx.is_last_backward:
            ctx.wait_reduce()
        for state in ctx.states:
            if state.group is not None:
                state.group.finalize_backward()
        ctx.callback_queued = False


class _ReducedThroughState:
    """A state's group as PyTorch's callers of ``_fsdp_param_groups`` use it (pipelining's REDUCE_GRAD step).

    ``post_backward()`` goes through the state, which keeps the reduce-scatter it starts until the final
    callback hands the gradients out; called on the bare group, that reduction would be dropped.
    """

    def __init__(self, state: FSDPState) -> None:
        self._state = state

    def post_backward(self) -> None:
        self._state._post_backward()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._state.group, name)


def _in_backward() -> bool:
    return torch._C._current_graph_task_id() != -1


def _init_fqns(root: nn.Module, states: list[FSDPState]) -> None:
    """Name parameters (error messages) and groups by their FQNs in the root, as PyTorch does."""
    module_names: dict[int, str] = {}
    for name, sub in root.named_modules(remove_duplicate=False):
        module_names.setdefault(id(sub), name)
    for state in states:
        group = state.group
        if group is None:
            continue
        group.module_fqn = ", ".join(module_names.get(id(m), "?") for m in state.modules)
        for fsdp_param in group.fsdp_params:
            module, param_name = fsdp_param.owners[0]
            if id(module) in module_names:
                prefix = module_names[id(module)]
                fsdp_param.fqn = f"{prefix}.{param_name}" if prefix else param_name


def _neighbour(order: list[FSDPState], index: dict[FSDPState, int], state: FSDPState, step: int
               ) -> list[FSDPState]:
    position = index.get(state)
    if position is None or not 0 <= position + step < len(order):
        return []
    return [order[position + step]]


def _register_pre_backward(state: FSDPState, output: Any) -> Any:
    if not torch.is_grad_enabled():
        return output

    def hook(_grad: torch.Tensor) -> None:
        state.pre_backward()

    def register(x: Any) -> Any:
        if isinstance(x, torch.Tensor) and x.requires_grad:
            x.register_hook(hook)
        return x

    if isinstance(output, torch.Tensor):  # the common output: no pytree walk needed
        register(output)
    else:
        tree_map(register, output)
    return output
