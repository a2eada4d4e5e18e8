"""PyTorch's deprecation warnings for the classic API, raised where PyTorch 2.13 raises them.

Same categories, and each message contains PyTorch's phrase (code filtering on
it keeps working), followed by what holds for this implementation.
"""

from __future__ import annotations

import warnings
from typing import Any

# Helper -> the public method -> its caller.
_CALLER = 3


def state_dict_type() -> None:
    warnings.warn("FSDP.state_dict_type() and FSDP.set_state_dict_type() are being deprecated in PyTorch in "
                  "favour of torch.distributed.checkpoint.state_dict.get_state_dict() / set_state_dict(); "
                  "this FullyShardedDataParallel keeps supporting them (PyTorch's helpers do not know it; "
                  "tensorplay.distributed.checkpoint.state_dict's do).", FutureWarning, stacklevel=_CALLER)


def legacy_optim_state_dict(current: str, replacement: str) -> None:
    warnings.warn(f"``FullyShardedDataParallel.{current}`` is being deprecated and is replaced by "
                  f"``FullyShardedDataParallel.{replacement}``.", FutureWarning, stacklevel=_CALLER)


def optim_input(value: Any) -> None:
    if value is not None:
        warnings.warn("The `optim_input` argument is deprecated; pass optim=<the optimizer> instead (or neither: "
                      "then the model's parameters in one group are assumed).", FutureWarning, stacklevel=_CALLER)


def no_shard() -> None:
    warnings.warn("The `NO_SHARD` sharding strategy is deprecated. If having issues, please use "
                  "`DistributedDataParallel` instead.", FutureWarning, stacklevel=_CALLER)


def container(module: Any) -> None:
    warnings.warn(f"FSDP will not all-gather parameters for containers that do not implement forward: "
                  f"{type(module).__name__} (wrap its children, or a module that calls them)", UserWarning,
                  stacklevel=_CALLER)
