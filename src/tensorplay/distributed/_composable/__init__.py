"""Composable APIs: ``checkpoint``, ``contract`` and ``replicate`` are PyTorch's own.

This package exists only so that ``_composable.fsdp``, the older import path of
``fully_shard``, gives our objects (the module below); every other name and
submodule resolves to PyTorch's ``_composable`` through the alias finder.
"""

from __future__ import annotations

import torch.distributed._composable as _torch_composable

# The submodules load under our names (aliases of PyTorch's) before the names below
# are bound, as in PyTorch's package: importing a submodule sets the package's
# attribute of that name, which must end up as the function, not the module.
import tensorplay.distributed._composable.checkpoint_activation
import tensorplay.distributed._composable.contract
import tensorplay.distributed._composable.replicate  # noqa: F401
from tensorplay import _alias

_get_registry = _torch_composable._get_registry
checkpoint = _torch_composable.checkpoint
contract = _torch_composable.contract
replicate = _torch_composable.replicate


def __getattr__(name: str) -> object:
    return _alias.alias_attribute(__name__, name)
