"""Refuse PyTorch's own FSDP and DCP helpers on our classic ``FullyShardedDataParallel`` where they would misread it.

Our wrapper is also PyTorch's ``FullyShardedDataParallel`` (type identity only), so
PyTorch's helpers take it for their own. Two kinds are refused here, on every rank,
before anything is gathered, loaded or written:

* ``torch.distributed.checkpoint.state_dict``'s helpers (``get_state_dict``,
  ``set_state_dict``, their model and optimizer variants, ``_patch_*_state_dict``).
  They would save the optimizer state as each rank's flat shard under one
  ``_flat_param`` key, which a DCP save writes as if it were replicated (every
  rank's shard but one is lost), and loads would fail midway. Every one of them
  first walks the model (``_verify_options``) and asks each module with children
  for its ``_fqn_modifiers()``, the hook those helpers offer modules whose
  state-dict keys differ from their attribute paths; nothing else in PyTorch calls
  it. Our wrapper answers with :func:`refusal`.
* PyTorch's FSDP helpers that run PyTorch's runtime on the wrapper
  (``torch...FullyShardedDataParallel.optim_state_dict(model, ...)``,
  ``summon_full_params``, ``clip_grad_norm_``, ``no_sync``, ...). They read
  PyTorch's private ``_FSDPState`` attributes first; ours answer with
  :func:`helper_refusal` ([Note: PyTorch's helpers on classic FSDP]).

No frame is inspected on any path but an error's own message.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from types import FrameType

from .._torch_types import is_torch_fsdp_module

__all__ = ["ForeignFSDPHelperError", "ForeignStateDictHelperError", "helper_refusal", "refusal"]

_TORCH_HELPERS = "torch.distributed.checkpoint.state_dict"
_OURS = "tensorplay.distributed.checkpoint.state_dict"
#: Inner functions of PyTorch's ``_patch_*_state_dict``: what the user called is the patched method.
_PATCHED = {f"{method}_call": f"{method}() as patched by {_TORCH_HELPERS}._patch_model_state_dict / "
                              "_patch_optimizer_state_dict" for method in ("state_dict", "load_state_dict")}


class ForeignFSDPHelperError(RuntimeError):
    """A PyTorch helper that does not know our classic FSDP was called on it."""


class ForeignStateDictHelperError(ForeignFSDPHelperError):
    """PyTorch's ``torch.distributed.checkpoint.state_dict`` helper was called on our classic FSDP."""


def refusal() -> ForeignStateDictHelperError:
    """The error to raise, naming the PyTorch helper that was called and ours to call instead."""
    helper = _calling_helper()
    return ForeignStateDictHelperError(
        f"PyTorch's {helper} does not know tensorplay's FullyShardedDataParallel: it would treat it as a plain "
        "module and save each rank's flat parameter shard (and its optimizer state) as if it were replicated, "
        f"or fail midway loading. Nothing was saved or loaded. Use {_OURS}'s functions of the same names and "
        "signatures (get_state_dict, set_state_dict, get_/set_model_state_dict, get_/set_optimizer_state_dict): "
        "they know it, and their checkpoints load into PyTorch's FSDP and back.")


def helper_refusal(attribute: str) -> ForeignFSDPHelperError:
    """The error for PyTorch's FSDP code reading ``_FSDPState.<attribute>`` of our wrapper, naming the helper."""
    frame = _outermost(is_torch_fsdp_module)
    if frame is None:  # read by code outside PyTorch's FSDP package
        helper, instead = "Code outside PyTorch's FSDP", "tensorplay.distributed.fsdp.FullyShardedDataParallel's API"
    else:
        module, name = frame.f_globals["__name__"], frame.f_code.co_name
        helper = f"PyTorch's {module}.{getattr(frame.f_code, 'co_qualname', name)}()"  # co_qualname: Python 3.11+
        instead = (f"tensorplay.distributed.fsdp.FullyShardedDataParallel.{name} (the same arguments)"
                   if not name.startswith("_") else "tensorplay.distributed.fsdp.FullyShardedDataParallel's API")
    return ForeignFSDPHelperError(
        f"{helper} read {attribute}, PyTorch's private FSDP state, of tensorplay's "
        "FullyShardedDataParallel, which is PyTorch's class for isinstance checks only and runs none of PyTorch's "
        f"FSDP internals; nothing was changed. Call {instead}; a framework that calls PyTorch's runs on ours "
        "after tensorplay.distributed.use_as_torch().")


def _calling_helper() -> str:
    """The outermost function of PyTorch's helper module on the stack (only ever run to word an error)."""
    frame = _outermost(lambda module: module == _TORCH_HELPERS)
    found = frame.f_code.co_name if frame is not None else None
    if found in _PATCHED:
        return _PATCHED[found]
    return f"{_TORCH_HELPERS}.{found}" if found else f"{_TORCH_HELPERS} helper"


def _outermost(matches: Callable[[str], bool]) -> FrameType | None:
    """The outermost frame on the stack whose module name ``matches`` (only ever run to word an error)."""
    frame: FrameType | None = sys._getframe(1)
    found = None
    while frame is not None:
        if matches(frame.f_globals.get("__name__", "")):
            found = frame
        frame = frame.f_back
    return found
