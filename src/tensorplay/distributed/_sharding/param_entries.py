"""What each parameter an optimizer can hold stands for in the model: its FQNs.

A front end whose optimizer parameters are not the model's own (classic FSDP's
flat parameter stands for every original parameter of its unit) offers the answer
on the modules it wraps (:func:`offer_param_entries`); code outside the front end
that keys optimizer state by FQN (``_NamedOptimizer``, ``ShardedMatrixOptimizer``'s
state dicts) asks :func:`param_entries`. The offer lives on the module: nothing
global, and the askers never import the front end.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from torch import nn

__all__ = ["ParamEntry", "offer_param_entries", "param_entries"]

_OFFER = "_tensorplay_param_entries"


@dataclass(frozen=True)
class ParamEntry:
    """What one optimizer parameter stands for: its FQNs (several for a flat parameter)."""

    fqns: tuple[str, ...]
    handle: Any = None         # the front end's flat-parameter handle; None: a parameter it does not manage
    slot: int | None = None    # which original parameter of the handle (one view per original parameter)


ParamEntries = Callable[[nn.Module], dict[int, ParamEntry]]


def offer_param_entries(module: nn.Module, entries: ParamEntries) -> None:
    """Say how to name the optimizer parameters of any model holding ``module`` (``id(param) -> ParamEntry``)."""
    module.__dict__[_OFFER] = entries


def param_entries(model: nn.Module) -> dict[int, ParamEntry]:
    """``id(param) -> ParamEntry`` for every parameter an optimizer of ``model`` can hold."""
    for module in model.modules():
        entries = module.__dict__.get(_OFFER)
        if entries is not None:
            return entries(model)
    return {id(param): ParamEntry((name,)) for name, param in model.named_parameters()}
