"""``Stateful``: PyTorch's protocol object itself (``save``/``load`` test ``isinstance`` against it)."""

from __future__ import annotations

from torch.distributed.checkpoint.stateful import Stateful, StatefulT

__all__ = ["Stateful", "StatefulT"]
