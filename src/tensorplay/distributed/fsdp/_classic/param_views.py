"""How a unit's original parameters appear on their modules: the ``use_orig_params`` modes.

``FlatParamViews`` (``use_orig_params=False``): the optimizer sees one flat
parameter per unit, registered as ``_flat_param``; the original names hold plain
tensor views while gathered. Inside ``summon_full_params`` the originals are
registered ``nn.Parameter`` views of the full tensor and ``_flat_param`` is
deregistered until exit, as PyTorch's FSDP shows them.

``OrigParamViews`` (``use_orig_params=True``): the original ``nn.Parameter``
objects stay registered and are what the optimizer sees; while sharded each one's
``data`` is its 1D piece of this rank's shard (possibly empty) and its ``grad`` the
matching piece of the sharded gradient.

[Note: plain-tensor views] During forward and backward, ``module.<name>`` must be
a view of the gathered flat buffer so autograd routes gradients to it. The view
goes into the instance ``__dict__``, which attribute lookup consults before
``nn.Module.__getattr__`` (``_parameters``), so registrations and their order
are left untouched; clearing the ``__dict__`` entry reveals the parameter again.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import nn

from ..._sharding.layout import FlatLayout

FLAT_PARAM = "_flat_param"


class FlatParamHandle(Protocol):
    """What the views read of a unit's flat parameter (``flat_param.FlatParamHandle``), without importing it."""

    flat_param: nn.Parameter
    layout: FlatLayout
    slots: list[ParamSlot]

    @property
    def is_sharded_over_ranks(self) -> bool: ...

    def local_ranges(self) -> list[tuple[int, int]]: ...

    def full_views(self, full: torch.Tensor) -> list[torch.Tensor]: ...


@dataclass(frozen=True)
class ParamSlot:
    """One original parameter: ``module.<name>``, named ``fqn`` under the unit; ``aliases`` share it (tied)."""

    fqn: str
    module: nn.Module
    name: str
    aliases: tuple[tuple[nn.Module, str], ...] = ()
    alias_fqns: tuple[str, ...] = ()        # the aliases' FQNs under the unit, in the same order

    def places(self) -> Iterator[tuple[nn.Module, str]]:
        yield self.module, self.name
        yield from self.aliases

    def fqns(self) -> tuple[str, ...]:
        """Every name the parameter has under the unit: its own first, then its aliases'."""
        return (self.fqn, *self.alias_fqns)


def set_plain(module: nn.Module, name: str, tensor: torch.Tensor) -> None:
    """Show ``tensor`` as ``module.<name>`` (see [Note: plain-tensor views])."""
    module.__dict__[name] = tensor


def clear_plain(module: nn.Module, name: str) -> None:
    module.__dict__.pop(name, None)


def shard_pieces(handle: FlatParamHandle, tensor: torch.Tensor) -> list[torch.Tensor]:
    """Each original parameter's part of ``tensor``, a 1D tensor laid out like this rank's shard."""
    return [tensor[start:end] for start, end in handle.local_ranges()]


def own_views(handle: FlatParamHandle, tensor: torch.Tensor) -> list[torch.Tensor]:
    """What each original parameter shows of ``tensor`` (laid out like this rank's shard) while sharded.

    1D pieces when the unit is sharded over ranks; the original shapes when it is
    not (NO_SHARD), where PyTorch's FSDP shows them too.
    """
    return shard_pieces(handle, tensor) if handle.is_sharded_over_ranks else handle.full_views(tensor)


def assign_grad(param: torch.Tensor, grad: torch.Tensor | None) -> None:
    """``param.grad = grad``, also when ``grad`` keeps a lower precision than ``param``."""
    if grad is None or grad.dtype == param.dtype:
        param.grad = grad
        return
    param.grad = torch.empty_like(param)
    param.grad.data = grad


class FlatParamViews:
    """``use_orig_params=False``: the flat parameter is the registered parameter."""

    owner: nn.Module   # where ``_flat_param`` lives (the wrapped module, even if later wrapped again)
    _placeholders: list[torch.Tensor] | None = None   # shown while sharded, made once per dtype

    def register(self, handle: FlatParamHandle, wrapped: nn.Module) -> None:
        self.owner = wrapped
        for slot in handle.slots:
            for module, name in slot.places():
                module._parameters[name] = None  # keeps the key's position for state dicts
        wrapped.register_parameter(FLAT_PARAM, handle.flat_param)
        self.expose_sharded(handle)

    def expose_sharded(self, handle: FlatParamHandle) -> None:
        if FLAT_PARAM not in self.owner._parameters:  # inside summon_full_params (expose_full)
            self._register_flat(handle)
        # Meta placeholders: shapes stay readable, any use of the data fails loudly.
        if self._placeholders is None or self._placeholders[0].dtype != handle.flat_param.dtype:  # dtype: an upcast
            self._placeholders = [torch.empty(shape, dtype=handle.flat_param.dtype, device="meta")
                                  for shape in handle.layout.shapes]
        self.expose_unsharded(handle, self._placeholders)

    def expose_unsharded(self, handle: FlatParamHandle, views: list[torch.Tensor]) -> None:
        for slot, view in zip(handle.slots, views, strict=True):
            for module, name in slot.places():
                set_plain(module, name, view)

    def expose_full(self, handle: FlatParamHandle, views: list[torch.Tensor]) -> None:
        """Register the originals as parameters viewing ``views`` and take ``_flat_param`` out of the way.

        Inside ``summon_full_params``, ``parameters()``, ``named_parameters()`` and
        ``state_dict()`` then show the original parameters, as PyTorch's FSDP does;
        :meth:`expose_sharded` undoes it.
        """
        del self.owner._parameters[FLAT_PARAM]
        for slot, view in zip(handle.slots, views, strict=True):
            param = nn.Parameter(view, requires_grad=handle.flat_param.requires_grad)
            for module, name in slot.places():
                clear_plain(module, name)
                module._parameters[name] = param  # in the placeholder's place: the unwrapped module's order

    def _register_flat(self, handle: FlatParamHandle) -> None:
        for slot in handle.slots:
            for module, name in slot.places():
                module._parameters[name] = None
        self.owner._parameters[FLAT_PARAM] = handle.flat_param  # last, where it was

    def sharded_grad(self, handle: FlatParamHandle) -> torch.Tensor | None:
        return handle.flat_param.grad

    def set_sharded_grad(self, handle: FlatParamHandle, grad: torch.Tensor) -> None:
        assign_grad(handle.flat_param, grad)

    def registered(self, handle: FlatParamHandle) -> list[nn.Parameter]:
        return [handle.flat_param]

    def per_original(self) -> bool:
        """Whether the optimizer sees each original parameter (else the one flat parameter)."""
        return False

    def expose_full_grads(self, handle: FlatParamHandle, grads: list[torch.Tensor]) -> None:
        raise AssertionError("flat parameters show no gradients per original parameter (see per_original)")

    def after_load(self, handle: FlatParamHandle) -> None:
        """Show the sharded state again after a state dict was loaded (the load replaced the plain views)."""
        self.expose_sharded(handle)


class OrigParamViews:
    """``use_orig_params=True``: the original parameters stay registered, backed by the flat shard."""

    originals: list[nn.Parameter]
    owner: nn.Module

    def __init__(self, originals: list[nn.Parameter]) -> None:
        self.originals = originals

    def register(self, handle: FlatParamHandle, wrapped: nn.Module) -> None:
        self.owner = wrapped
        wrapped.__dict__[FLAT_PARAM] = handle.flat_param
        self.expose_sharded(handle)

    def expose_sharded(self, handle: FlatParamHandle) -> None:
        for slot, param, piece in zip(handle.slots, self.originals,
                                      own_views(handle, handle.flat_param.data), strict=True):
            param.data = piece
            for module, name in slot.places():
                clear_plain(module, name)

    def expose_unsharded(self, handle: FlatParamHandle, views: list[torch.Tensor]) -> None:
        for slot, view in zip(handle.slots, views, strict=True):
            for module, name in slot.places():
                set_plain(module, name, view)

    def expose_full(self, handle: FlatParamHandle, views: list[torch.Tensor]) -> None:
        for param, view in zip(self.originals, views, strict=True):
            param.data = view

    def sharded_grad(self, handle: FlatParamHandle) -> torch.Tensor | None:
        # The optimizer's zero_grad() clears the originals' grads, not the flat one's.
        if all(param.grad is None for param in self.originals):
            return None
        return handle.flat_param.grad

    def set_sharded_grad(self, handle: FlatParamHandle, grad: torch.Tensor) -> None:
        assign_grad(handle.flat_param, grad)
        for param, piece in zip(self.originals, own_views(handle, grad), strict=True):
            assign_grad(param, piece if piece.numel() and param.requires_grad else None)

    def registered(self, handle: FlatParamHandle) -> list[nn.Parameter]:
        return list(self.originals)

    def per_original(self) -> bool:
        return True

    def expose_full_grads(self, handle: FlatParamHandle, grads: list[torch.Tensor]) -> None:
        for param, grad in zip(self.originals, grads, strict=True):
            param.grad = grad

    def after_load(self, handle: FlatParamHandle) -> None:
        pass  # the originals are views of the flat shard, which the load wrote into


ParamViews = FlatParamViews | OrigParamViews
