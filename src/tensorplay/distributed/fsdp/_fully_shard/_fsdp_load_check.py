"""All-or-nothing ``load_state_dict`` for fully_shard modules.

See [Note: all-or-nothing loads] in ``_checks.load_check``.

``nn.Module.load_state_dict`` copies every key that fits and raises at the end,
so a state dict with one missing or wrong-shape key leaves a half-loaded model,
and a state dict bad on one rank only leaves the ranks disagreeing. A fully_shard
module first checks every key and (global) shape on every rank, and that each
DTensor given holds this rank's part of the parameter as the model shards it
(``dtensor_problem``), agrees across the ranks its parameters live on, and only
then lets ``nn.Module`` copy.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

import tensorplay.distributed as dist
from tensorplay.distributed import ProcessGroup
from tensorplay.distributed._checks.load_check import (
    check_load_on_all_ranks,
    dtensor_problems,
    with_sharding_hint,
)


def check_load(module: nn.Module, state_dict: Mapping[str, Any], strict: bool) -> None:
    """Raise one ``StateDictLoadError`` on every rank if ``state_dict`` does not fit ``module`` on any rank.

    Every missing / unexpected key (unless ``strict=False``) and every wrong shape
    (global shapes: a DTensor's, as in ``module.state_dict()``) is listed with both
    shapes, and every DTensor whose part on this rank is not the model's (another
    sharding) with both layouts. Collective over the ranks of the sharded parameters' mesh.
    """
    # The class's method: PyTorch's _patch_model_state_dict replaces the instance's with one taking no arguments.
    current = type(module).state_dict(module, keep_vars=True)
    expected = {key: value if isinstance(value, torch.Tensor) else None for key, value in current.items()}
    check_load_on_all_ranks(expected, state_dict, where=type(module).__name__, strict=strict,
                            group=_agreement_group(current.values()),
                            extra=with_sharding_hint(dtensor_problems(current, state_dict)))


def _agreement_group(values: Any) -> ProcessGroup | None:
    """The group of every rank the module's DTensors live on (None: the default group, or nothing sharded)."""
    mesh = next((v.device_mesh for v in values if isinstance(v, DTensor)), None)
    if mesh is None or not dist.is_initialized() or mesh.size() == dist.get_world_size():
        return None
    return mesh.get_group() if mesh.ndim == 1 else mesh._flatten().get_group()
