"""Composable APIs: ``checkpoint``, ``contract`` and ``replicate`` are PyTorch's own.

This package exists only so that ``_composable.fsdp``, the older import path of
``fully_shard``, gives our objects (the module below); every other name and
submodule resolves to PyTorch's ``_composable`` through the alias finder.
"""

from __future__ import annotations

from torch.distributed._composable import _get_registry, checkpoint, contract, replicate  # noqa: F401

# Load the submodules under our names first, as PyTorch's package does, so that
# the function bindings below are not overwritten when the submodule is imported.
import tensorplay.distributed._composable.checkpoint_activation
import tensorplay.distributed._composable.contract
import tensorplay.distributed._composable.replicate  # noqa: F401
from tensorplay import _alias


def __getattr__(name: str) -> object:
    return _alias.alias_attribute(__name__, name)
