"""Policies passed to :func:`fully_shard`: mixed precision and offloading (frozen values, not flags)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tensorplay.distributed._shard.validation import check_bool, check_dtype

__all__ = ["CPUOffloadPolicy", "MixedPrecisionPolicy", "OffloadPolicy"]


@dataclass(frozen=True)
class MixedPrecisionPolicy:
    """Dtypes for the all-gathered parameters, the gradient reduction and the module outputs.

    ``param_dtype``: dtype of the unsharded parameters used in forward/backward
    (the sharded parameters keep their original dtype). ``reduce_dtype``: dtype
    of the gradient reduce-scatter (default: ``param_dtype``). ``output_dtype``:
    dtype floating-point forward outputs are cast to. ``cast_forward_inputs``:
    cast floating-point forward inputs to ``param_dtype``.
    """

    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    output_dtype: torch.dtype | None = None
    cast_forward_inputs: bool = True

    def __post_init__(self) -> None:
        for name in ("param_dtype", "reduce_dtype", "output_dtype"):
            check_dtype(getattr(self, name), name, "MixedPrecisionPolicy")
        check_bool(self.cast_forward_inputs, "cast_forward_inputs", "MixedPrecisionPolicy")


@dataclass(frozen=True)
class OffloadPolicy:
    """No offloading: sharded parameters and gradients live on the mesh's device."""

    def sharded_device(self, compute_device: torch.device) -> torch.device:
        """Where the sharded parameters and gradients live."""
        return compute_device

    def place(self, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor`` prepared to live as a sharded parameter or gradient."""
        return tensor


@dataclass(frozen=True)
class CPUOffloadPolicy(OffloadPolicy):
    """Keep sharded parameters and gradients on the CPU; the optimizer steps there.

    Each all-gather copies the shard to the compute device and each
    reduce-scatter's result comes back to the CPU. ``pin_memory`` pins the CPU
    tensors for faster copies; unlike PyTorch's, it is ignored (instead of
    failing) on a machine without an accelerator, where nothing can be pinned.
    """

    pin_memory: bool = True

    def __post_init__(self) -> None:
        check_bool(self.pin_memory, "pin_memory", "CPUOffloadPolicy")

    def sharded_device(self, compute_device: torch.device) -> torch.device:
        return torch.device("cpu")

    def place(self, tensor: torch.Tensor) -> torch.Tensor:
        tensor = tensor.cpu()
        if self.pin_memory and _can_pin() and not tensor.is_pinned():
            tensor = tensor.pin_memory()
        return tensor


def _can_pin() -> bool:
    accelerator = getattr(torch, "accelerator", None)
    return bool(accelerator is not None and accelerator.is_available())
