"""Communication hooks of classic FSDP units: the user's function replaces the gradient reduction.

PyTorch's contract: a sharded unit calls ``hook(state, grad, output)`` with the
padded, flat, unsharded gradient and a tensor for this rank's reduced shard;
a NO_SHARD unit calls ``hook(state, grad)``, which reduces ``grad`` in place.
The hook does everything the default reduction does (dividing included), so
PyTorch's FSDP default hooks (``allreduce_hook``, ``reduce_scatter_hook`` with a
``DefaultState``) reproduce the default path. Hooks that compress the gradient
themselves (``fp16_compress_hook``, ``bf16_compress_hook``) receive it uncast.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from ..api import ShardingStrategy


@dataclass(frozen=True)
class CommHook:
    state: Any
    hook: Callable[..., None]
    compresses: bool    # casts the gradient itself: hand it over in the computed dtype

    def reduce_sharded(self, grad: torch.Tensor, shard_numel: int) -> torch.Tensor:
        output = grad.new_empty(shard_numel)
        self.hook(self.state, grad, output)
        return output  # the hook may have replaced its .data (low-precision hooks do)

    def reduce_replicated(self, grad: torch.Tensor) -> torch.Tensor:
        self.hook(self.state, grad)
        return grad


#: Hooks that cast the gradient themselves (PyTorch's FSDP fp16/bf16 compression hooks are named so), so FSDP
#: hands the gradient over uncast. Told by name: nothing of PyTorch's FSDP hook package is imported here.
_COMPRESSING_HOOKS = frozenset({"fp16_compress_hook", "bf16_compress_hook"})


def is_compressing_hook(hook: Callable) -> bool:
    """Whether ``hook`` is a low-precision compression hook (by its name, as PyTorch's are)."""
    return getattr(hook, "__name__", None) in _COMPRESSING_HOOKS


def check_signature(hook: Callable, sharded: bool, strategy: ShardingStrategy) -> None:
    try:
        signature = inspect.signature(hook)
    except (TypeError, ValueError):
        return  # builtins without a signature: trust the caller
    form = "hook(state, grad, output)" if sharded else "hook(state, grad)"
    try:
        signature.bind(*([None] * (3 if sharded else 2)))
    except TypeError as error:
        name = getattr(hook, "__name__", repr(hook))
        raise TypeError(f"register_comm_hook: hook {name!r} cannot be called as {form}, which {strategy.name} "
                        f"units call ({error}); sharded strategies pass the unsharded gradient and a tensor for "
                        "this rank's reduced shard, NO_SHARD only the gradient to reduce in place") from None
