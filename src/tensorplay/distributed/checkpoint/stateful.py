"""``Stateful``: PyTorch's protocol object itself (``save``/``load`` test ``isinstance`` against it)."""

from __future__ import annotations

from torch.distributed.checkpoint.stateful import Stateful, StatefulT

__all__ = ["Stateful", "StatefulT"]


def __getattr__(name: str) -> object:
    """Any other name of PyTorch's ``torch.distributed.checkpoint.stateful`` (the same object)."""
    import torch.distributed.checkpoint.stateful as torch_module

    try:
        return getattr(torch_module, name)
    except AttributeError:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None
