"""The one way to ask whether there is an accelerator, and which."""

from __future__ import annotations

import torch


def current_accelerator() -> torch.device | None:
    """This process's current accelerator device (type and index), or None when there is none (CPU only)."""
    if not torch.accelerator.is_available():
        return None
    accelerator = torch.accelerator.current_accelerator()
    assert accelerator is not None  # is_available() said there is one
    return torch.device(accelerator.type, torch.accelerator.current_device_index())
