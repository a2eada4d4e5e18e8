"""Where sharded state lives (storage) and where it is computed on: the one offload model.

Offloading is a setting of :class:`Placement` (storage on the host, compute on
the accelerator), not a flag tested throughout a runtime: moving between the two
is a no-op when both devices are the same. Classic FSDP builds one from
``CPUOffload``, fully_shard from ``OffloadPolicy`` / ``CPUOffloadPolicy``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .devices import current_accelerator

_HOST = torch.device("cpu")


@dataclass(frozen=True)
class Placement:
    """``storage_device``: sharded parameters and gradients; ``compute_device``: gathered parameters, forward, backward.

    ``pin_memory``: pin tensors moved to host storage (for faster copies to the
    accelerator); ignored where nothing can be pinned (no accelerator).
    """

    storage_device: torch.device
    compute_device: torch.device
    pin_memory: bool = False

    @classmethod
    def on(cls, compute_device: torch.device, offload: bool = False, pin_memory: bool = False) -> Placement:
        """Compute on ``compute_device``; store there too, or on the host when ``offload``."""
        return cls(_HOST if offload else compute_device, compute_device, pin_memory)

    def to_compute(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.to(self.compute_device, non_blocking=True)

    def to_storage(self, tensor: torch.Tensor) -> torch.Tensor:
        if tensor.device != self.storage_device:
            tensor = tensor.to(self.storage_device)
        if self.pin_memory and tensor.device == _HOST and not tensor.is_pinned() \
                and current_accelerator() is not None:
            tensor = tensor.pin_memory()
        return tensor
