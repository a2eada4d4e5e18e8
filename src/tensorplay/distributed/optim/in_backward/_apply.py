"""Step each parameter's optimizer inside ``backward()``, as soon as its gradient is ready.

    apply_optimizer_in_backward(tp.optim.SGD, model.parameters(), {"lr": 0.01})
    model(x).sum().backward()   # parameters already updated; their .grad is None

Each parameter gets its own optimizer (``optimizer_class([param], **kwargs)``),
stepped by a post-accumulate-grad hook, after which ``param.grad`` is freed: the
whole model's gradients never exist at once. The optimizers hang off the
parameter under the attribute names PyTorch uses (``_in_backward_optimizers``,
``_optimizer_classes``, ``_optimizer_kwargs``), so code reading them keeps
working. :func:`_get_in_backward_optimizers` returns them for checkpointing.

With DDP, call ``_register_optim_in_backward_hook(ddp_model)`` after wrapping
(``ddp_comm_hooks.optimizer_overlap_hooks``): PyTorch's DDP treats parameters
carrying ``_in_backward_optimizers`` specially, and its own path needs an
accelerator and PyTorch's distributed optim package (on CPU it fails).

Each listing of a parameter is one optimizer that steps once per backward, as
with class optimizers: a parameter listed twice (in one call, or in two calls,
e.g. a weight tied between two modules whose ``parameters()`` are passed
separately) steps twice, as ``SGD([w, w])`` or two optimizers over ``w`` would;
listing it twice in one call warns as the class optimizer does. (A tied weight
reached through one ``model.parameters()`` is listed once, so it steps once.)
The hook is registered once per parameter and steps every optimizer attached
to it.

Accumulation and global-norm clipping are keyword-only options of ours
(``options=InBackwardOptions(accumulation_steps=K, max_norm=1.0,
clip_mode="exact" | "previous")``; see ``_options.py`` for the
memory price of each clipping mode). They apply to the parameters of one call.

With fully_shard, call this after ``fully_shard`` on the sharded parameters:
each steps as soon as its reduce-scatter lands and its sharded gradient is
freed right after (``fsdp/_fully_shard/_fsdp_optim_in_backward.py``); with
classic FSDP, after wrapping, once the unit's gradient shard is reduced
(``fsdp/_classic/optim_in_backward.py``); with DDP, once each bucket is
averaged, in its comm hook (``_register_optim_in_backward_hook``). All three
say so through the "gradient ready" hook point (``_sharding/grad_ready.py``),
on which :func:`grad_ready` is registered for each parameter, so the options
work the same on each and no front end imports this package.

Unlike PyTorch, a plain optimizer stepping a parameter that has in-backward
optimizers raises (PyTorch silently skips it: its ``.grad`` is None), naming
the parameter's position and shape.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable
from typing import Any

import torch
from torch import Tensor
from torch.optim.optimizer import register_optimizer_step_pre_hook
from torch.utils.weak import WeakTensorKeyDictionary

from tensorplay.distributed._checks.validation import check_bool, check_instance, check_iterable, check_mapping
from tensorplay.distributed._sharding.grad_ready import register_grad_ready_hook
from tensorplay.distributed.optim.in_backward._group import InBackwardGroup
from tensorplay.distributed.optim.in_backward._options import InBackwardOptions

__all__ = ["InBackwardOptions", "_apply_optimizer_in_backward", "_get_in_backward_optimizers",
           "apply_optimizer_in_backward", "grad_ready"]

#: param -> handle of its post-accumulate-grad hook (weak: the parameter's lifetime is untouched).
_hook_handles: WeakTensorKeyDictionary = WeakTensorKeyDictionary()


def _apply_optimizer_in_backward(
    optimizer_class: type[torch.optim.Optimizer],
    params: Iterable[Tensor],
    optimizer_kwargs: dict[str, Any],
    register_hook: bool = True,
    *,
    options: InBackwardOptions | None = None,
) -> None:
    """Attach ``optimizer_class(**optimizer_kwargs)`` to each of ``params``, stepped inside backward.

    Args:
        optimizer_class: a ``tp.optim`` optimizer class (any ``Optimizer`` subclass),
            or (ours) a functional optimizer class such as ``_FunctionalAdam``,
            stepped with ``step_param(param, param.grad)``.
        params: leaf tensors that require grad; each listing attaches one optimizer
            (a parameter listed twice steps twice per backward, with a warning).
        optimizer_kwargs: options for each per-parameter optimizer (``lr`` ...).
        register_hook: False only attaches the optimizers, for a caller that
            steps them itself (after its own gradient reduction, say).
        options: accumulation and global-norm clipping (keyword-only, ours);
            None steps once per backward without clipping, as PyTorch does.

    After ``backward()`` these parameters have ``.grad`` None; a plain
    optimizer that also holds one of them raises at its ``step()``.

    Example:
        >>> import tensorplay as tp
        >>> from tensorplay.distributed.optim import apply_optimizer_in_backward
        >>> model = tp.nn.Linear(4, 2)
        >>> apply_optimizer_in_backward(tp.optim.SGD, model.parameters(), {"lr": 0.1})
        >>> before = model.weight.detach().clone()
        >>> model(tp.ones(1, 4)).sum().backward()            # stepped inside backward
        >>> model.weight.grad is None, bool((model.weight != before).all())
        (True, True)
    """
    params = _checked_args(optimizer_class, params, optimizer_kwargs, register_hook)
    options = check_instance(options, InBackwardOptions, "options", "apply_optimizer_in_backward",
                             optional=True) or InBackwardOptions()
    _check_groups_compose(params, options)
    group = InBackwardGroup(options)
    if len({id(param) for param in params}) != len(params):
        warnings.warn("optimizer contains a parameter group with duplicate parameters; each listing of a "
                      "parameter attaches one optimizer, so it steps once per listing in every backward "
                      "(as a class optimizer steps a duplicated parameter once per entry)", stacklevel=2)
    for param in params:  # every check passed: nothing is attached to any parameter before that
        _attach(param, optimizer_class, optimizer_kwargs, group)
        if register_hook and param not in _hook_handles:
            _hook_handles[param] = param.register_post_accumulate_grad_hook(_step_in_backward)


#: The public name the seeds use.
apply_optimizer_in_backward = _apply_optimizer_in_backward


def _get_in_backward_optimizers(module: torch.nn.Module) -> list[torch.optim.Optimizer]:
    """The in-backward optimizers of ``module``'s parameters, in parameter order, each once.

    For checkpointing (``state_dict`` / ``load_state_dict``, or all of them at once
    through ``tensorplay.distributed.checkpoint.state_dict.get_state_dict`` /
    ``set_state_dict`` under any front end, classic FSDP included; the norm that
    ``clip_mode="previous"`` clips the next step with is saved in their param
    groups); they are stepped by backward, not by calling ``step`` directly.

    Example:
        >>> import tensorplay as tp
        >>> from tensorplay.distributed.optim import _apply_optimizer_in_backward, _get_in_backward_optimizers
        >>> model = tp.nn.Linear(4, 2)
        >>> _apply_optimizer_in_backward(tp.optim.SGD, model.parameters(), {"lr": 0.1})
        >>> [type(o).__name__ for o in _get_in_backward_optimizers(model)]
        ['SGD', 'SGD']
    """
    optimizers: list[torch.optim.Optimizer] = []
    for param in module.parameters():
        optimizers.extend(getattr(param, "_in_backward_optimizers", []))
    return optimizers


def _checked_args(optimizer_class: Any, params: Any, optimizer_kwargs: Any, register_hook: Any) -> list[Tensor]:
    """The parameters as a list, once every argument is valid (a rejected call attaches nothing)."""
    where = "apply_optimizer_in_backward"
    if not (isinstance(optimizer_class, type) and (issubclass(optimizer_class, torch.optim.Optimizer)
                                                    or callable(getattr(optimizer_class, "step_param", None)))):
        raise TypeError(f"{where}: optimizer_class must be a torch.optim.Optimizer subclass (e.g. tp.optim.SGD) or "
                        f"a functional optimizer with step_param (e.g. _FunctionalAdam), got {optimizer_class!r}")
    check_mapping(optimizer_kwargs, "optimizer_kwargs", where, optional=False)
    check_bool(register_hook, "register_hook", where)
    listed = check_iterable(params, "params", where, optional=False)
    assert listed is not None  # optional=False
    for index, param in enumerate(listed):
        _check_param(param, index)
    if listed:
        try:  # the options are the optimizer's to judge; say which call failed
            first = listed[0]
            optimizer_class([torch.zeros(1, dtype=first.dtype, device=first.device, requires_grad=True)],
                            **optimizer_kwargs)
        except (TypeError, ValueError) as error:
            kind = ValueError if isinstance(error, ValueError) else TypeError
            raise kind(f"{where}: {optimizer_class.__name__}(params, **optimizer_kwargs) with "
                       f"optimizer_kwargs={dict(optimizer_kwargs)!r} failed: {error}") from error
    return listed


def _check_param(param: object, index: int) -> None:
    if not isinstance(param, Tensor):
        raise TypeError(f"apply_optimizer_in_backward: params[{index}] must be a Tensor, got {type(param).__name__}")
    if not param.is_leaf:
        raise ValueError(f"apply_optimizer_in_backward: params[{index}] is not a leaf tensor (computed by "
                         f"{type(param.grad_fn).__name__}); only leaf parameters accumulate gradients")
    if not param.requires_grad:
        raise ValueError(f"apply_optimizer_in_backward: params[{index}] does not require grad, so backward would "
                         "never step it; call requires_grad_() on it or leave it out")


def _check_groups_compose(params: list[Tensor], options: InBackwardOptions) -> None:
    """Options apply to whole calls: a parameter with options belongs to no other call."""
    for index, param in enumerate(params):
        groups = getattr(param, "_in_backward_groups", [])
        if groups and (not options.is_default or any(not g.options.is_default for g in groups)):
            raise ValueError(f"apply_optimizer_in_backward: params[{index}] (shape {list(param.shape)}) already has "
                             "in-backward optimizers from another call, and one of the two calls has "
                             "InBackwardOptions (accumulation/clipping); give each parameter to one such call")
    if not options.is_default and len({id(param) for param in params}) != len(params):
        raise ValueError("apply_optimizer_in_backward: a parameter is listed twice in a call with InBackwardOptions; "
                         "list each parameter once")


def _attach(param: Tensor, optimizer_class: type, optimizer_kwargs: dict[str, Any], group: InBackwardGroup) -> None:
    if not hasattr(param, "_in_backward_optimizers"):
        param._in_backward_optimizers = []  # type: ignore[attr-defined]
        param._optimizer_classes = []  # type: ignore[attr-defined]
        param._optimizer_kwargs = []  # type: ignore[attr-defined]
        param._in_backward_groups = []  # type: ignore[attr-defined]
        register_grad_ready_hook(param, grad_ready)  # front ends that set .grad themselves say so through it
    optimizer = optimizer_class([param], **optimizer_kwargs)
    param._in_backward_optimizers.append(optimizer)  # type: ignore[attr-defined]
    param._optimizer_classes.append(optimizer_class)  # type: ignore[attr-defined]
    param._optimizer_kwargs.append(optimizer_kwargs)  # type: ignore[attr-defined]
    if not any(g is group for g in param._in_backward_groups):  # type: ignore[attr-defined]
        param._in_backward_groups.append(group)  # type: ignore[attr-defined]
    group.add(param, optimizer)
    _refuse_plain_optimizers()


def grad_ready(param: Tensor, shard_groups: tuple[object, ...] = (), ranks: tuple[object, ...] = ()) -> None:
    """``param.grad`` is final for this backward: step its in-backward optimizers (or keep the gradient, as
    their options say) and free it. Front ends that set ``.grad`` themselves (fully_shard, classic FSDP, DDP)
    call this; ``shard_groups`` are the groups a plain-tensor gradient is a shard over (for the clipping
    norm), ``ranks`` the groups that together hold every rank training it (to check accumulation counts).

    Example:
        >>> import tensorplay as tp
        >>> from tensorplay.distributed.optim.apply_optimizer_in_backward import apply_optimizer_in_backward, grad_ready
        >>> weight = tp.nn.Parameter(tp.ones(2))
        >>> apply_optimizer_in_backward(tp.optim.SGD, [weight], {"lr": 0.5}, register_hook=False)
        >>> weight.grad = tp.ones(2)                        # a front end set the final gradient itself
        >>> grad_ready(weight)
        >>> weight.detach(), weight.grad
        (tensor([0.5000, 0.5000]), None)
    """
    groups = param._in_backward_groups  # type: ignore[attr-defined]
    keep = [group.grad_ready(param, shard_groups, ranks) for group in groups]
    if not any(keep):
        param.grad = None


def remove_post_accumulate_hook(param: Tensor) -> None:
    """Stop stepping ``param`` from its post-accumulate-grad hook (a front end hands its gradient over instead)."""
    handle = _hook_handles.pop(param, None)
    if handle is not None:
        handle.remove()


def _step_in_backward(param: Tensor) -> None:
    """The post-accumulate-grad hook of a plain module's parameter."""
    grad_ready(param)


_plain_optimizer_check: list[Any] = []  # the handle of the global step pre-hook, once per process


def _refuse_plain_optimizers() -> None:
    """Make a plain optimizer's step over an in-backward parameter raise (it would silently skip it).

    A global step pre-hook, registered once per process; it holds no state, so
    ranks that are threads of one process share it safely.
    """
    if not _plain_optimizer_check:
        _plain_optimizer_check.append(register_optimizer_step_pre_hook(_check_plain_step))


def _check_plain_step(optimizer: torch.optim.Optimizer, args: object, kwargs: object) -> None:
    if getattr(optimizer, "_steps_in_backward", False):
        return
    for group_index, group in enumerate(optimizer.param_groups):
        for index, param in enumerate(group["params"]):
            owners = getattr(param, "_in_backward_optimizers", None)
            if owners is not None and all(owner is not optimizer for owner in owners):
                raise ValueError(f"{type(optimizer).__name__}.step(): param_groups[{group_index}]['params'][{index}] "
                                 f"(shape {list(param.shape)}) has optimizers applied in backward "
                                 "(apply_optimizer_in_backward), which step it and free its gradient; leave it out "
                                 "of this optimizer")

