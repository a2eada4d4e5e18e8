"""Every matrix's whole state on every rank, for full (unsharded) state dicts of the owner scheme.

In ``ShardedMatrixOptimizer``'s owner scheme (Muon, any class but Adafactor) a matrix's state lives whole on
its owner rank; the other ranks of its shard group hold ``{}`` for it. A full state dict needs it everywhere.
Per exchange group: one ``all_gather_object`` tells every rank what each owner holds for its matrices (each
tensor's shape, dtype and device type; any other value as it is), then each owner broadcasts its tensors
over the group. Nothing here knows the optimizer class: whatever keys its state has travel.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

import tensorplay.distributed as dist
from tensorplay.distributed._comm import objects
from tensorplay.distributed._comm.collectives import broadcast

from ._exchange import GroupExchange


@dataclass(frozen=True)
class TensorSpec:
    """What a rank needs to receive a state tensor: its shape, dtype and where the owner keeps it."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    device_type: str


def whole_states(exchange: GroupExchange, states: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``states`` (this rank's entry per matrix of ``exchange``: whole on its owner, ``{}`` elsewhere) as every
    rank sees it after the owners send theirs: each matrix's owner entry, on every rank (collective)."""
    owned = {k: _described(states[k]) for k, owner in enumerate(exchange.owners) if owner == exchange.rank}
    described: list[dict[int, dict[str, Any]] | None] = [None] * exchange.world_size
    objects.all_gather_object(described, owned, exchange.group, where=exchange.sources[0].name)
    wholes = []
    for k, owner in enumerate(exchange.owners):
        entry = described[owner]
        assert entry is not None
        wholes.append({key: _received(exchange, k, owner, states[k].get(key), spec)
                       if isinstance(spec, TensorSpec) else spec for key, spec in entry[k].items()})
    return wholes


def _described(state: dict[str, Any]) -> dict[str, Any]:
    """``state`` with each tensor replaced by its :class:`TensorSpec` (the other values travel as they are)."""
    return {key: TensorSpec(tuple(value.shape), value.dtype, value.device.type) if isinstance(value, torch.Tensor)
            else value for key, value in state.items()}


def _received(exchange: GroupExchange, k: int, owner: int, mine: torch.Tensor | None,
              spec: TensorSpec) -> torch.Tensor:
    """Matrix ``k``'s state tensor ``spec`` broadcast from its owner (the owner keeps its own tensor)."""
    source = exchange.sources[k]
    device = source.local(source.param).device   # the group's communication device
    if owner == exchange.rank:
        assert mine is not None
        broadcast(mine.detach().to(device).contiguous(), owner, exchange.group, where=source.name)
        return mine
    tensor = torch.empty(spec.shape, dtype=spec.dtype, device=device)
    broadcast(tensor, owner, exchange.group, where=source.name)
    return tensor if spec.device_type == device.type else tensor.to(spec.device_type)


def check_loadable(state_dict: dict[str, Any], what: str) -> None:
    """Raise naming this rank when ``state_dict`` is not an optimizer state dict (e.g. the ``{}`` that a full
    state dict taken with ``cpu_offload=True`` leaves on ranks other than 0)."""
    if "param_groups" not in state_dict or "state" not in state_dict:
        rank = dist.get_rank() if dist.is_initialized() else 0
        raise ValueError(f"{what}: rank {rank} got a state dict without 'state' and 'param_groups' (keys "
                         f"{sorted(state_dict)}); a full state dict taken with cpu_offload=True is kept by rank 0 "
                         "only (the others get {}): load rank 0's on every rank")
