"""Step a functional optimizer on each DDP bucket as soon as its gradients are reduced.

    from tensorplay.distributed.optim import as_functional_optim
    from tensorplay.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    state = _OptimizerHookState(as_functional_optim(tp.optim.Adam, lr=1e-3))
    ddp_model.register_comm_hook(None, _hook_then_optimizer(allreduce_hook, state))
    loss.backward()   # each bucket: all-reduce, then the optimizer step on its parameters

The optimizer step of one bucket overlaps the communication of the next, and no
separate ``optimizer.step()`` follows backward.

Differences from PyTorch's ``_hook_then_optimizer``, each to avoid a silent
wrong result or lost speed:

* a failed communication future fails the step; PyTorch's steps anyway, on
  un-reduced gradients;
* when the wrapped hook resolves to a tensor other than the bucket's buffer, that
  result is copied into the buffer before the step (PyTorch's steps on the buffer
  as it was);
* an optimizer offering ``step_params`` (ours do) steps the whole bucket at
  once, so ``foreach=True`` runs one multi-tensor kernel per bucket.

With ``apply_optimizer_in_backward`` (each parameter's own optimizer), DDP
needs a hook that steps those optimizers once a bucket is reduced:
:func:`_apply_optim_in_backward_hook`, installed on a DDP model by
:func:`_register_optim_in_backward_hook` (see [Note: DDP and optimizers in
backward] there for why that call is explicit).

DDP compares hook annotations with ``dist.GradBucket`` and
``torch.futures.Future[torch.Tensor]``, so this module keeps real annotations
(no ``from __future__ import annotations``).
"""

import contextlib
import weakref
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
from torch.autograd import Variable

import tensorplay.distributed as dist
from tensorplay.distributed._sharding.grad_ready import grad_ready

__all__: list = []

Hook = Callable[[Any, dist.GradBucket], torch.futures.Future[torch.Tensor]]

_STEP_METHOD = "step_param"


class _OptimizerHookState:
    """A functional optimizer (anything with ``step_param(param, grad)``) and, optionally,
    the parameters it owns: others in a bucket are reduced but not stepped by the hook.

    Example:
        >>> import tensorplay as tp
        >>> from tensorplay.nn.parallel import DistributedDataParallel as DDP
        >>> from tensorplay.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
        >>> from tensorplay.distributed.algorithms.ddp_comm_hooks.optimizer_overlap_hooks import (
        ...     _hook_then_optimizer, _OptimizerHookState)
        >>> from tensorplay.distributed.optim import as_functional_optim
        >>> model = DDP(tp.nn.Linear(16, 4))
        >>> state = _OptimizerHookState(as_functional_optim(tp.optim.SGD, lr=0.1))
        >>> model.register_comm_hook(None, _hook_then_optimizer(allreduce_hook, state))
        >>> before = model.module.weight.detach().clone()
        >>> model(tp.randn(8, 16)).sum().backward()     # each bucket all-reduced, then stepped, inside backward
        >>> tp.equal(model.module.weight, before)
        False
    """

    __slots__ = ("functional_optimizer", "params_to_optimize")

    def __init__(self, functional_optim: Any, params: Iterable[torch.Tensor] | None = None) -> None:
        if not hasattr(functional_optim, _STEP_METHOD):
            raise ValueError(
                f"{type(functional_optim).__name__} has no {_STEP_METHOD}(param, grad) method, so it cannot step "
                "inside a DDP hook; build one with tensorplay.distributed.optim.as_functional_optim(<optim class>, "
                "...)")
        self.functional_optimizer = functional_optim
        self.params_to_optimize = set(params) if params is not None else None


def _hook_then_optimizer(hook: Hook, optimizer_state: _OptimizerHookState) -> Hook:
    """Wrap ``hook`` so that, once its future resolves, the bucket's parameters take an optimizer step.

    Example:
        >>> import tensorplay as tp
        >>> from tensorplay.nn.parallel import DistributedDataParallel as DDP
        >>> from tensorplay.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
        >>> from tensorplay.distributed.algorithms.ddp_comm_hooks.optimizer_overlap_hooks import (
        ...     _hook_then_optimizer, _OptimizerHookState)
        >>> from tensorplay.distributed.optim import as_functional_optim
        >>> model = DDP(tp.nn.Linear(16, 4))
        >>> state = _OptimizerHookState(as_functional_optim(tp.optim.SGD, lr=0.1))
        >>> model.register_comm_hook(None, _hook_then_optimizer(allreduce_hook, state))
        >>> before = model.module.weight.detach().clone()
        >>> model(tp.randn(8, 16)).sum().backward()     # each bucket all-reduced, then stepped, inside backward
        >>> tp.equal(model.module.weight, before)
        False
    """

    def hook_then_optimizer_wrapper(hook_state: Any, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        communicated = hook(hook_state, bucket)

        def step_bucket(fut: torch.futures.Future[Any]) -> torch.Tensor:
            buffer = bucket.buffer()
            _adopt_result(buffer, fut.value())  # .value() re-raises a failed communication
            _step(optimizer_state, bucket.parameters(), bucket.gradients())
            return buffer

        return communicated.then(step_bucket)

    return hook_then_optimizer_wrapper


def _adopt_result(buffer: torch.Tensor, result: Any) -> None:
    if isinstance(result, (list, tuple)) and len(result) == 1:
        result = result[0]
    if isinstance(result, torch.Tensor) and result.data_ptr() != buffer.data_ptr():
        buffer.copy_(result.view_as(buffer))


def _step(state: _OptimizerHookState, params: list[torch.Tensor], grads: list[torch.Tensor]) -> None:
    if state.params_to_optimize is not None:
        chosen = [(p, g) for p, g in zip(params, grads, strict=True) if p in state.params_to_optimize]
        params, grads = [p for p, _ in chosen], [g for _, g in chosen]
    optimizer = state.functional_optimizer
    if hasattr(optimizer, "step_params"):
        optimizer.step_params(params, grads)
        return
    for param, grad in zip(params, grads, strict=True):
        optimizer.step_param(param, grad)


@dataclass
class _OptimInBackwardHookState:
    """The stream the in-backward optimizer steps run on, and whether the end-of-backward wait is queued.

    Example:
        >>> import tensorplay as tp
        >>> from tensorplay.nn.parallel import DistributedDataParallel as DDP
        >>> from tensorplay.distributed.algorithms.ddp_comm_hooks.optimizer_overlap_hooks import (
        ...     _register_optim_in_backward_hook)
        >>> from tensorplay.distributed.optim import _apply_optimizer_in_backward
        >>> model = tp.nn.Linear(16, 4)
        >>> _apply_optimizer_in_backward(tp.optim.SGD, model.parameters(), {"lr": 0.1})
        >>> ddp = DDP(model)
        >>> _register_optim_in_backward_hook(ddp)       # registers _apply_optim_in_backward_hook
        >>> ddp(tp.randn(8, 16)).sum().backward()       # averaged, stepped; the gradients are then None
        >>> model.weight.grad is None
        True
    """

    optim_stream: torch.Stream
    wait_for_optim_stream_enqueued: bool


def _apply_optim_in_backward_hook(
    gradient_is_bucket_view: bool,
) -> Callable[[Any, dist.GradBucket], torch.futures.Future[torch.Tensor]]:
    """A DDP hook (state: a weak reference to the DDP module) that averages each bucket with DDP's reducer and
    then hands its parameters to their in-backward optimizers (``grad_ready``), which step them, or keep the
    averaged gradient as their ``InBackwardOptions`` say (accumulation, exact clipping, a grad scaler: the
    kept gradients step at the end of backward); after the stepping backward their grads are None.

    ``gradient_is_bucket_view`` is the DDP module's ``gradient_as_bucket_view``:
    when False, each parameter's ``.grad`` is pointed at its averaged bucket
    slice before the step. Install it with :func:`_register_optim_in_backward_hook`.
    Unlike PyTorch's hook, this one runs without an accelerator (the stream is
    used only when it is an accelerator stream), and parameters without
    in-backward optimizers end backward with their averaged gradient in
    ``.grad`` whatever ``gradient_is_bucket_view`` is (PyTorch's leaves this
    rank's own there when it is False), so a plain optimizer can step them.

    Example:
        >>> import tensorplay as tp
        >>> from tensorplay.nn.parallel import DistributedDataParallel as DDP
        >>> from tensorplay.distributed.algorithms.ddp_comm_hooks.optimizer_overlap_hooks import (
        ...     _register_optim_in_backward_hook)
        >>> from tensorplay.distributed.optim import _apply_optimizer_in_backward
        >>> model = tp.nn.Linear(16, 4)
        >>> _apply_optimizer_in_backward(tp.optim.SGD, model.parameters(), {"lr": 0.1})
        >>> ddp = DDP(model)
        >>> _register_optim_in_backward_hook(ddp)       # registers _apply_optim_in_backward_hook
        >>> ddp(tp.randn(8, 16)).sum().backward()       # averaged, stepped; the gradients are then None
        >>> model.weight.grad is None
        True
    """
    state = _OptimInBackwardHookState(optim_stream=torch.Stream(), wait_for_optim_stream_enqueued=False)
    hook = partial(_optim_in_backward_bucket, optim_stream_state=state,
                   gradient_is_bucket_view=gradient_is_bucket_view)
    # DDP logs a hook by its qualified name.
    hook.__name__ = hook.__qualname__ = "apply_optim_in_backward_hook"  # type: ignore[attr-defined]
    return hook


def _optim_in_backward_bucket(hook_state: Any, bucket: dist.GradBucket, optim_stream_state: _OptimInBackwardHookState,
                              gradient_is_bucket_view: bool) -> torch.futures.Future[torch.Tensor]:
    ddp = _live_ddp(hook_state)
    reduced = ddp.reducer._run_allreduce_hook(bucket)  # sums; the division is ours
    if not optim_stream_state.wait_for_optim_stream_enqueued:
        # Queued before the first grad_ready: callbacks run in queueing order, so the in-backward groups'
        # end of backward (clipping, stepping kept gradients) runs after the optimizer stream is waited on.
        Variable._execution_engine.queue_callback(lambda: _end_of_backward(optim_stream_state))
        optim_stream_state.wait_for_optim_stream_enqueued = True
    stream = optim_stream_state.optim_stream
    with stream if stream.device.type != "cpu" else contextlib.nullcontext():
        reduced.wait()
        bucket.buffer().div_(ddp.process_group.size())
        for param, grad in zip(bucket.parameters(), bucket.gradients(), strict=True):
            _step_or_adopt(param, grad, gradient_is_bucket_view, ddp.process_group)
    result: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    result.set_result(bucket.buffer())
    return result


def _step_or_adopt(param: torch.Tensor, averaged: torch.Tensor, gradient_is_bucket_view: bool,
                   group: dist.ProcessGroup) -> None:
    """Hand ``param``'s averaged gradient to its in-backward optimizers (``grad_ready``: they step, or keep it
    for accumulation or clipping, and free it); a parameter without any gets the average as its ``.grad``
    (for an optimizer stepped after backward)."""
    in_backward = hasattr(param, "_in_backward_groups")
    if gradient_is_bucket_view:
        pass  # .grad already is the averaged bucket slice
    elif in_backward:
        param.grad = averaged  # the reducer averaged the bucket, not .grad
    elif param.grad is not None:
        # DDP in this mode leaves .grad alone; PyTorch's hook leaves this rank's own gradient there.
        param.grad.copy_(averaged)
    if not in_backward:
        return
    grad_ready(param, ranks=(group,))
    if not gradient_is_bucket_view and any(g.accumulating(param) for g in param._in_backward_groups):  # type: ignore[attr-defined]
        # Kept for the next backward: in this mode DDP's reducer refuses a .grad inside its bucket then, so the
        # gradient gets its own storage, as DDP's own .grad has. (Kept for the end of this backward, by exact
        # clipping or a grad scaler, it stays the bucket slice: no copy.)
        param.grad = averaged.clone()


def _live_ddp(hook_state: Any) -> Any:
    ddp = hook_state() if isinstance(hook_state, weakref.ref) else None
    if ddp is None:
        raise TypeError(f"apply_optim_in_backward_hook: the hook state must be a live weakref.ref to the DDP module, "
                        f"got {type(hook_state).__name__}; install the hook with "
                        f"_register_optim_in_backward_hook(ddp_model)")
    return ddp


def _end_of_backward(state: _OptimInBackwardHookState) -> None:
    """Wait for the optimizer stream. The gradients are the in-backward groups' to free (``grad_ready``
    frees a stepped one at once; a kept one is freed by its group's end of backward, queued after this)."""
    if state.optim_stream.device.type != "cpu":
        torch.accelerator.current_stream().wait_stream(state.optim_stream)
    state.wait_for_optim_stream_enqueued = False


# [Note: DDP and optimizers in backward]
# PyTorch's DDP handles parameters carrying ``_in_backward_optimizers`` by
# itself, at its first forward (``_setup_in_backward_optimizers``): it removes
# the per-parameter hooks listed in PyTorch's own optimizer package (a module
# global, reached as an attribute chain from PyTorch's distributed package:
# AttributeError when nothing imported that optim package yet; our hooks are not listed there, so on a GPU they
# would keep stepping on this rank's un-averaged gradients, silently), then
# registers PyTorch's hook, imported from PyTorch's comm-hook package by
# absolute path, whose end-of-backward callback asks for the current
# accelerator stream and raises "Cannot access accelerator device" on CPU. Both
# lookups are hard-coded in DDP, and the rule of this package (no imports of
# PyTorch's owned subtrees, no process-global state) leaves no way to redirect
# them. So the set-up is one explicit call after wrapping and before the first
# forward; it does what DDP's would, with our objects, and marks DDP's lazy
# initialisation (which does nothing else in 2.13) as done.


def _register_optim_in_backward_hook(ddp_model: Any) -> None:
    """Make DDP step the in-backward optimizers of its parameters on averaged gradients.

        apply_optimizer_in_backward(tp.optim.Adam, model.parameters(), {"lr": 1e-3})
        ddp_model = DistributedDataParallel(model)
        _register_optim_in_backward_hook(ddp_model)     # before the first forward
        ddp_model(x).sum().backward()                   # averaged, stepped, grads None

    The optimizers' ``InBackwardOptions`` apply as on the other front ends:
    ``no_sync()`` micro-batches accumulate and the step comes in the backward
    of the synchronizing one; clipping norms are of the averaged (replicated)
    gradients, so no collective is added for them.

    Removes the parameters' own post-accumulate-grad hooks (they would step on
    this rank's gradients alone), registers :func:`_apply_optim_in_backward_hook`
    and tells DDP's reducer that optimizers run in backward. See [Note: DDP and
    optimizers in backward] for why this is not automatic.
    """
    from tensorplay.distributed.optim.in_backward import remove_post_accumulate_hook  # optim imports this package

    _check_ddp_for_optim_in_backward(ddp_model)
    for param in ddp_model._get_data_parallel_params(ddp_model.module):
        remove_post_accumulate_hook(param)
    ddp_model.register_comm_hook(weakref.ref(ddp_model),
                                 _apply_optim_in_backward_hook(gradient_is_bucket_view=ddp_model.gradient_as_bucket_view))
    ddp_model.reducer._set_optimizer_in_backward()
    ddp_model._lazy_init_ran = True  # DDP's lazy init would register PyTorch's hook a second time


def _check_ddp_for_optim_in_backward(ddp_model: Any) -> None:
    if not isinstance(ddp_model, torch.nn.parallel.DistributedDataParallel):
        raise TypeError(f"_register_optim_in_backward_hook: ddp_model must be a DistributedDataParallel, got "
                        f"{type(ddp_model).__name__}; wrap the model first")
    if ddp_model._lazy_init_ran or ddp_model._comm_hooks:
        raise ValueError("_register_optim_in_backward_hook: this DDP model already ran a forward or has a comm hook; "
                         "call it once, right after wrapping, before the first forward and before any "
                         "register_comm_hook")
    if not any(hasattr(p, "_in_backward_optimizers") for p in ddp_model._get_data_parallel_params(ddp_model.module)):
        raise ValueError("_register_optim_in_backward_hook: no parameter managed by this DDP model has in-backward "
                         "optimizers; call apply_optimizer_in_backward(optimizer_class, params, kwargs) on the "
                         "model's parameters first")
