"""The whole-model load check a sharding front end offers to loads it does not drive.

``set_model_state_dict`` on a plain root that holds sharded modules loads through
``nn.Module``'s walk; to keep it all or nothing the checkpoint package wraps that
walk in the check the front end offered on its modules ([Note: load through a
plain parent] in ``fsdp/_load_guard.py``): the state dict is checked against the
whole model on every rank first, and the walk then copies without checking again.
The offer lives on the wrapped modules: nothing global, and the checkpoint package
never imports the front end.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager
from typing import Any

from torch import nn

__all__ = ["WholeLoadCheck", "offer_whole_load_check", "whole_load_check"]

_OFFER = "_tensorplay_whole_load_check"

#: ``check(model, state_dict, strict)``: a context manager that checks on entry and loads inside unchecked.
WholeLoadCheck = Callable[[nn.Module, Mapping[str, Any], bool], AbstractContextManager[None]]


def offer_whole_load_check(module: nn.Module, check: WholeLoadCheck) -> None:
    """Say how a load of any model holding the sharded ``module`` is checked whole."""
    module.__dict__[_OFFER] = check


def whole_load_check(model: nn.Module) -> WholeLoadCheck | None:
    """The check offered inside ``model``; None when ``model`` itself is sharded (its own ``load_state_dict``
    checks) or holds nothing sharded."""
    if _OFFER in model.__dict__:
        return None
    return next((m.__dict__[_OFFER] for m in model.modules() if _OFFER in m.__dict__), None)
