"""Refuse PyTorch's DCP state-dict helpers on our classic ``FullyShardedDataParallel``, which they do not know.

``torch.distributed.checkpoint.state_dict``'s helpers (``get_state_dict``,
``set_state_dict``, their model and optimizer variants, ``_patch_*_state_dict``)
recognise classic FSDP by PyTorch's class. On ours they take the wrapper for a
plain module: the optimizer state comes out as each rank's flat shard under one
``_flat_param`` key, which a DCP save writes as if it were replicated (every
rank's shard but one is lost), and loads fail midway.

How they are stopped: every one of those helpers first walks the model
(``_verify_options``) and asks each module with children for its
``_fqn_modifiers()``, the hook those helpers offer modules whose state-dict keys
differ from their attribute paths; nothing else in PyTorch calls it. Our wrapper
answers with :func:`refusal`, on every rank, before anything is gathered, loaded
or written, and at no cost anywhere else (no frame inspection on any path but
the error's own message).
"""

from __future__ import annotations

import sys

__all__ = ["ForeignStateDictHelperError", "refusal"]

_TORCH_HELPERS = "torch.distributed.checkpoint.state_dict"
_OURS = "tensorplay.distributed.checkpoint.state_dict"
#: Inner functions of PyTorch's ``_patch_*_state_dict``: what the user called is the patched method.
_PATCHED = {f"{method}_call": f"{method}() as patched by {_TORCH_HELPERS}._patch_model_state_dict / "
                              "_patch_optimizer_state_dict" for method in ("state_dict", "load_state_dict")}


class ForeignStateDictHelperError(RuntimeError):
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


def _calling_helper() -> str:
    """The outermost function of PyTorch's helper module on the stack (only ever run to word an error)."""
    frame, found = sys._getframe(1), None
    while frame is not None:
        if frame.f_globals.get("__name__") == _TORCH_HELPERS:
            found = frame.f_code.co_name
        frame = frame.f_back  # type: ignore[assignment]
    if found in _PATCHED:
        return _PATCHED[found]
    return f"{_TORCH_HELPERS}.{found}" if found else f"{_TORCH_HELPERS} helper"
