"""Average parameters across a process group: one flat buffer, one all-reduce."""

from __future__ import annotations

import functools
from collections.abc import Iterable, Iterator
from typing import Any

import torch

import tensorplay.distributed as dist
from tensorplay.distributed._comm import collectives

__all__ = ["average_parameters", "average_parameters_or_parameter_groups", "get_params_to_average"]

ParamsOrGroups = Iterable[torch.Tensor] | Iterable[dict[str, Any]]


def resolve_group(process_group: dist.ProcessGroup | None) -> dist.ProcessGroup:
    """``process_group``, or the default group when it is ``None``."""
    if process_group is not None and process_group is not dist.GroupMember.NON_GROUP_MEMBER \
            and not isinstance(process_group, dist.ProcessGroup):
        raise TypeError(f"Arg ``process_group`` must be a ProcessGroup or None (the default group), got "
                        f"{process_group!r} ({type(process_group).__name__})")
    group = process_group if process_group is not None else dist.group.WORLD
    if group is None:
        raise RuntimeError("model averaging needs a process group: call tensorplay.distributed."
                           "init_process_group() first, or pass process_group explicitly")
    return group


def average_parameters(params: Iterable[torch.Tensor] | Iterator[torch.Tensor],
                       process_group: dist.ProcessGroup | None) -> None:
    """Replace each parameter by its mean over ``process_group`` (``None``: the default group), in place.

    The parameters are packed into one flat buffer (in their promoted dtype, so
    mixed dtypes round-trip), divided by the group size, summed by a single
    all-reduce and copied back into the same tensors. A rank outside the group
    keeps its parameters. Every rank of the group must pass the same shapes in
    the same order.

    Unlike PyTorch's version, which rebinds each ``p.data`` to a slice of the
    buffer, the parameters keep their own storage.

    Example:
        >>> import tensorplay as tp
        >>> import tensorplay.distributed as dist
        >>> from tensorplay.distributed.algorithms.model_averaging.utils import average_parameters
        >>> model = tp.nn.Linear(4, 2)
        >>> average_parameters(model.parameters(), dist.group.WORLD)   # one all-reduce of all of them
    """
    group = resolve_group(process_group)
    if dist.get_rank(group) < 0:  # not a member of this group
        return
    params = list(params)
    if not params:
        return
    # Divide before summing: a sum of 16-bit values must not overflow.
    flat = _pack_divided(params, group.size())
    if flat.device.type != "cpu":
        # Other groups (DDP's, say) may still be writing these parameters on another stream.
        torch.accelerator.synchronize(flat.device)
    collectives.all_reduce(flat, group, fingerprint=True)  # named by the averager's site (its step)
    _copy_back(params, flat)


def _pack_divided(params: list[torch.Tensor], divisor: int) -> torch.Tensor:
    """The parameters divided by ``divisor``, packed into one 1D buffer of their promoted dtype.

    The same values as ``torch.cat(...) / divisor``. On CPU each parameter is
    divided straight into its slice (one pass over memory instead of two); on
    an accelerator one cat and one division keep it to two kernel launches.
    """
    if params[0].device.type != "cpu":
        return torch.cat([p.detach().reshape(-1) for p in params]).div_(divisor)
    dtype = functools.reduce(torch.promote_types, (p.dtype for p in params))
    flat = torch.empty(sum(p.numel() for p in params), dtype=dtype, device=params[0].device)
    for p, chunk in zip(params, flat.split([p.numel() for p in params]), strict=True):
        source = p.detach().reshape(-1)
        if source.dtype == dtype:
            torch.div(source, divisor, out=chunk)
        else:  # cast first, then divide in the promoted dtype, as the cat would
            chunk.copy_(source).div_(divisor)
    return flat


def _copy_back(params: list[torch.Tensor], flat: torch.Tensor) -> None:
    chunks = flat.split([p.numel() for p in params])
    with torch.no_grad():
        torch._foreach_copy_(params, [chunk.view_as(p) for chunk, p in zip(chunks, params, strict=True)])


def get_params_to_average(params: ParamsOrGroups) -> list[torch.Tensor]:
    """The parameters that have a gradient, from parameters or an optimizer's ``param_groups``.

    Example:
        >>> import tensorplay as tp
        >>> from tensorplay.distributed.algorithms.model_averaging.utils import get_params_to_average
        >>> model = tp.nn.Linear(4, 2)
        >>> model.bias.requires_grad_(False)
        Parameter containing:
        tensor(...)
        >>> model(tp.randn(1, 4)).sum().backward()
        >>> [p.shape for p in get_params_to_average(model.parameters())]   # only those with a gradient
        [torch.Size([2, 4])]
    """
    selected: list[torch.Tensor] = []
    for index, item in enumerate(params):
        if isinstance(item, torch.Tensor):
            candidates = [item]
        elif isinstance(item, dict):
            candidates = item["params"]
        else:
            raise NotImplementedError(
                f"params[{index}] is a {type(item).__name__}; pass parameters (model.parameters()) "
                f"or parameter groups (optimizer.param_groups)")
        selected.extend(p for p in candidates if p.grad is not None)
    return selected


def average_parameters_or_parameter_groups(params: ParamsOrGroups,
                                           process_group: dist.ProcessGroup | None) -> None:
    """Average the parameters that have a gradient, given as parameters or ``param_groups``.

    Example:
        >>> import tensorplay as tp
        >>> import tensorplay.distributed as dist
        >>> from tensorplay.distributed.algorithms.model_averaging.utils import average_parameters_or_parameter_groups
        >>> model = tp.nn.Linear(4, 2)
        >>> optimizer = tp.optim.SGD(model.parameters(), lr=0.1)
        >>> average_parameters_or_parameter_groups(optimizer.param_groups, dist.group.WORLD)
    """
    average_parameters(get_params_to_average(params), process_group)
