"""Where sharded parameters live and where they are computed on, and in which dtypes.

Where: the shared :class:`~tensorplay.distributed._sharding.placement.Placement`
(offload is its setting, storage on the host), built from ``CPUOffload`` by
:func:`placement_for`. Dtypes: :class:`Precision`, resolved from ``MixedPrecision``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten

from tensorplay.distributed._sharding.casting import cast_floating
from tensorplay.distributed._sharding.placement import Placement

from ..api import CPUOffload, MixedPrecision


def placement_for(compute_device: torch.device, cpu_offload: CPUOffload | None) -> Placement:
    """Compute on ``compute_device``; keep the sharded parameters on the host with ``offload_params``."""
    return Placement.on(compute_device, offload=cpu_offload is not None and cpu_offload.offload_params)


@dataclass(frozen=True)
class Precision:
    """Resolved dtypes of one unit (``MixedPrecision`` fields with their fallbacks applied)."""

    param_dtype: torch.dtype        # gathered parameters and the computation
    reduce_dtype: torch.dtype       # gradient reduction
    grad_dtype: torch.dtype         # sharded gradients handed to the optimizer
    buffer_dtype: torch.dtype | None
    cast_forward_inputs: bool
    cast_root_forward_inputs: bool

    @classmethod
    def resolve(cls, config: MixedPrecision | None, full_dtype: torch.dtype) -> Precision:
        config = config or MixedPrecision()
        param_dtype = config.param_dtype or full_dtype
        reduce_dtype = config.reduce_dtype or config.param_dtype or full_dtype
        grad_dtype = reduce_dtype if config.keep_low_precision_grads else full_dtype
        return cls(param_dtype, reduce_dtype, grad_dtype, config.buffer_dtype,
                   config.cast_forward_inputs, config.cast_root_forward_inputs)


def compute_in_full_precision(module: nn.Module) -> None:
    """Make ``module`` compute in float32 and hand its output back in its input's dtype.

    For the modules ``MixedPrecision._module_classes_to_ignore`` names (batch
    norms), which become units without mixed precision between units with it.
    The input dtype is remembered per call, on the module's own hook closure.
    """
    seen: list[torch.dtype] = []

    def before(_: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        seen.clear()
        seen.extend({value.dtype for value in tree_flatten((args, kwargs))[0]
                     if isinstance(value, torch.Tensor) and value.is_floating_point()
                     and value.dtype != torch.float32})
        return cast_floating(torch.float32, (args, kwargs))

    def after(_: nn.Module, args: tuple, output: Any) -> Any:
        return cast_floating(seen[0], output) if seen else output

    module.register_forward_pre_hook(before, with_kwargs=True)
    module.register_forward_hook(after)
