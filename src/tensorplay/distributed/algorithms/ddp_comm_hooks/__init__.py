"""DDP communication hooks: how DDP reduces each gradient bucket.

Register one on a ``DistributedDataParallel`` model with
``model.register_comm_hook(state, hook)``, or by kind with
``register_ddp_comm_hook(DDPCommHookType.POWER_SGD, model, state=process_group)``.
The plain hooks live in :mod:`.default_hooks` (``allreduce_hook``,
``fp16_compress_hook``, ``bf16_compress_hook``, re-exported here); PowerSGD in
:mod:`.powerSGD_hook`; 8-bit all-gather averaging in :mod:`.quantization_hooks`;
``noop_hook`` in :mod:`.debugging_hooks`; DDP's mixed-precision hook in
:mod:`.mixed_precision_hooks`; the post-local SGD hook in
:mod:`.post_localSGD_hook` (``PostLocalSGDState`` is re-exported; the function
``post_localSGD_hook.post_localSGD_hook`` is not, because its name is the
module's and PyTorch users import the module by that path).
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from enum import Enum
from functools import partial
from typing import Any

from . import (
    debugging_hooks,
    default_hooks,
    mixed_precision_hooks,
    optimizer_overlap_hooks,
    post_localSGD_hook,
    powerSGD_hook,
    quantization_hooks,
)

# The short aliases PyTorch's package binds (``ddp_comm_hooks.powerSGD.PowerSGDState`` ...).
from . import debugging_hooks as debugging  # noqa: F401
from . import default_hooks as default  # noqa: F401
from . import optimizer_overlap_hooks as optimizer_overlap  # noqa: F401
from . import powerSGD_hook as powerSGD  # noqa: F401
from . import quantization_hooks as quantization  # noqa: F401
from .default_hooks import (
    allreduce_hook,
    bf16_compress_hook,
    bf16_compress_wrapper,
    fp16_compress_hook,
    fp16_compress_wrapper,
)
from .post_localSGD_hook import PostLocalSGDState

__all__ = [
    "DDPCommHookType",
    "PostLocalSGDState",
    "allreduce_hook",
    "bf16_compress_hook",
    "bf16_compress_wrapper",
    "debugging_hooks",
    "default_hooks",
    "fp16_compress_hook",
    "fp16_compress_wrapper",
    "mixed_precision_hooks",
    "optimizer_overlap_hooks",
    "post_localSGD_hook",
    "powerSGD_hook",
    "quantization_hooks",
    "register_ddp_comm_hook",
]


def _enum_member(value: Any) -> Any:
    # A partial in an Enum body is a member only when wrapped (Python 3.11+; 3.13 warns otherwise).
    if sys.version_info >= (3, 11):
        from enum import member

        return member(value)
    return value


def _ddp_comm_hook_wrapper(comm_hook: Callable, model: Any, state: Any) -> None:
    """Register ``comm_hook`` on the DDP ``model`` with ``state`` (a process group or None) as its state."""
    model.register_comm_hook(state, comm_hook)


def _powerSGD_comm_hook_wrapper(comm_hook: Callable, model: Any, state: Any, matrix_approximation_rank: int,
                                start_powerSGD_iter: int = 1_000) -> None:
    """Register a PowerSGD hook with a fresh ``PowerSGDState`` over the process group ``state``."""
    powerSGD_state = powerSGD_hook.PowerSGDState(process_group=state,
                                                 matrix_approximation_rank=matrix_approximation_rank,
                                                 start_powerSGD_iter=start_powerSGD_iter)
    model.register_comm_hook(powerSGD_state, comm_hook)


class DDPCommHookType(Enum):
    """The hooks of this package by name; each value registers its hook: ``X.value(model=ddp, state=group)``.

    Example:
        >>> import tensorplay as tp
        >>> from tensorplay.nn.parallel import DistributedDataParallel as DDP
        >>> from tensorplay.distributed.algorithms.ddp_comm_hooks import DDPCommHookType, register_ddp_comm_hook
        >>> model = DDP(tp.nn.Linear(16, 4))
        >>> register_ddp_comm_hook(DDPCommHookType.FP16_COMPRESS, model)
        >>> model(tp.randn(8, 16)).sum().backward()     # the hook reduces each gradient bucket
    """

    ALLREDUCE = _enum_member(partial(_ddp_comm_hook_wrapper, comm_hook=default_hooks.allreduce_hook))
    FP16_COMPRESS = _enum_member(partial(_ddp_comm_hook_wrapper, comm_hook=default_hooks.fp16_compress_hook))
    BF16_COMPRESS = _enum_member(partial(_ddp_comm_hook_wrapper, comm_hook=default_hooks.bf16_compress_hook))
    QUANTIZE_PER_TENSOR = _enum_member(
        partial(_ddp_comm_hook_wrapper, comm_hook=quantization_hooks.quantization_pertensor_hook))
    QUANTIZE_PER_CHANNEL = _enum_member(
        partial(_ddp_comm_hook_wrapper, comm_hook=quantization_hooks.quantization_perchannel_hook))
    POWER_SGD = _enum_member(
        partial(_powerSGD_comm_hook_wrapper, comm_hook=powerSGD_hook.powerSGD_hook, matrix_approximation_rank=1))
    # Rank 2 can be more accurate than rank 1, at more compute and memory.
    POWER_SGD_RANK2 = _enum_member(
        partial(_powerSGD_comm_hook_wrapper, comm_hook=powerSGD_hook.powerSGD_hook, matrix_approximation_rank=2))
    # Batching the whole bucket is faster and usually less accurate.
    BATCHED_POWER_SGD = _enum_member(
        partial(_powerSGD_comm_hook_wrapper, comm_hook=powerSGD_hook.batched_powerSGD_hook,
                matrix_approximation_rank=1))
    BATCHED_POWER_SGD_RANK2 = _enum_member(
        partial(_powerSGD_comm_hook_wrapper, comm_hook=powerSGD_hook.batched_powerSGD_hook,
                matrix_approximation_rank=2))
    NOOP = _enum_member(partial(_ddp_comm_hook_wrapper, comm_hook=debugging_hooks.noop_hook))


def register_ddp_comm_hook(comm_hook_type: DDPCommHookType, model: Any, state: Any = None) -> None:
    """Register the hook named by ``comm_hook_type`` on the DDP ``model``; ``state`` is a process group or None.

        register_ddp_comm_hook(DDPCommHookType.FP16_COMPRESS, ddp_model, process_group)

    Example:
        >>> import tensorplay as tp
        >>> from tensorplay.nn.parallel import DistributedDataParallel as DDP
        >>> from tensorplay.distributed.algorithms.ddp_comm_hooks import DDPCommHookType, register_ddp_comm_hook
        >>> model = DDP(tp.nn.Linear(16, 4))
        >>> register_ddp_comm_hook(DDPCommHookType.FP16_COMPRESS, model)
        >>> model(tp.randn(8, 16)).sum().backward()     # the hook reduces each gradient bucket
    """
    if not isinstance(comm_hook_type, DDPCommHookType):
        raise TypeError(f"register_ddp_comm_hook: comm_hook_type must be a DDPCommHookType member (e.g. "
                        f"DDPCommHookType.ALLREDUCE), got {comm_hook_type!r}")
    comm_hook_type.value(model=model, state=state)
