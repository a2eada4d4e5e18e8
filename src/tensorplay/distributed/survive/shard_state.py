"""One rank's shard of a sharded model and its optimizer, as one flat buffer, and the whole state back from
every old rank's buffer (the in-memory W -> W-1 reshard).

[Note: the shard's flat layout]
For each sharded parameter, in ``named_parameters()`` order: its local rows, then each optimizer state
tensor in key order (a state tensor shaped like the parameter, a DTensor: its local rows; any other
tensor, e.g. Adam's ``step``: whole), then, when asked, its gradient's local rows. A rank's rows of a
dimension of ``length`` are ``_sharding.layout.rank_slice(length, world, rank)``, the split fully_shard
uses, so every rank can size any other rank's buffer from the shapes alone.
"""

from __future__ import annotations

from dataclasses import dataclass
from math import prod

import torch
from torch.distributed.tensor import DTensor

from .._sharding.layout import rank_slice

__all__ = ["FullState", "ShardParts", "ShardSpec", "full_state", "load_full_state", "pack_shard", "shard_parts",
           "specs", "unpack_shard"]


@dataclass(frozen=True)
class ShardSpec:
    """What one sharded parameter contributes to a shard's buffer: its FQN, its global shape, and for each
    optimizer state key whether the state is sharded like it (else its numel, the same on every rank)."""

    fqn: str
    shape: torch.Size
    state: tuple[tuple[str, bool, int], ...]  # (key, sharded, numel when not sharded)

    def numel(self, rank: int, world: int, with_grads: bool) -> int:
        rows = rank_slice(self.shape[0], world, rank).size * prod(self.shape[1:])
        sharded = 1 + sum(1 for _, is_sharded, _ in self.state if is_sharded) + int(with_grads)
        return rows * sharded + sum(numel for _, is_sharded, numel in self.state if not is_sharded)


def specs(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> list[ShardSpec]:
    """The :class:`ShardSpec` of every parameter of ``model`` (each must be a DTensor: a fully_shard model)."""
    found = []
    for fqn, param in model.named_parameters():
        if not isinstance(param, DTensor):
            raise ValueError(f"survive.Job(redundancy='buddy'): parameter {fqn!r} is not sharded (not a DTensor); "
                             "the buddy copy covers fully_shard models whose every parameter is sharded")
        state = []
        for key, value in sorted(optimizer.state.get(param, {}).items()):
            if not isinstance(value, torch.Tensor):
                raise ValueError(f"survive.Job(redundancy='buddy'): optimizer state {key!r} of {fqn!r} is a "
                                 f"{type(value).__name__}, not a tensor; the buddy copy holds tensors only")
            state.append((key, isinstance(value, DTensor), 0 if isinstance(value, DTensor) else value.numel()))
        found.append(ShardSpec(fqn, param.shape, tuple(state)))
    return found


@dataclass
class ShardParts:
    """One old rank's shard buffer cut into its tensors, by FQN: ``param``, ``state[key]``, ``grad``."""

    param: dict[str, torch.Tensor]
    state: dict[str, dict[str, torch.Tensor]]
    grad: dict[str, torch.Tensor]


def pack_shard(model: torch.nn.Module, optimizer: torch.optim.Optimizer, with_grads: bool) -> torch.Tensor:
    """This rank's shard as one flat buffer (see [Note: the shard's flat layout])."""
    pieces = []
    for _, param in model.named_parameters():
        state = optimizer.state.get(param, {})
        pieces.append(_local(param))
        pieces += [_local(state[key]) for key in sorted(state)]
        if with_grads:
            grad = param.grad
            pieces.append(_local(grad) if grad is not None else torch.zeros_like(_local(param)))
    dtypes = {piece.dtype for piece in pieces}
    if len(dtypes) > 1:
        raise ValueError(f"survive.Job(redundancy='buddy'): the shard's tensors have several dtypes "
                         f"{sorted(map(str, dtypes))}; the buddy copy holds one dtype")
    return torch.cat([piece.detach().reshape(-1) for piece in pieces]) if pieces else torch.empty(0)


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def shard_parts(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> ShardParts:
    """This rank's shard as :class:`ShardParts` (parameters and optimizer state; no gradients)."""
    parts = ShardParts({}, {}, {})
    for fqn, param in model.named_parameters():
        parts.param[fqn] = _local(param).detach()
        parts.state[fqn] = {key: _local(value) for key, value in sorted(optimizer.state.get(param, {}).items())}
    return parts


def unpack_shard(flat: torch.Tensor, shard_specs: list[ShardSpec], rank: int, world: int,
                 with_grads: bool) -> ShardParts:
    """The inverse of :func:`pack_shard` for old rank ``rank`` of ``world``."""
    parts, cursor = ShardParts({}, {}, {}), 0

    def take(shape: tuple[int, ...]) -> torch.Tensor:
        nonlocal cursor
        numel = prod(shape)
        piece = flat[cursor: cursor + numel].view(shape)
        cursor += numel
        return piece

    for spec in shard_specs:
        rows = (rank_slice(spec.shape[0], world, rank).size, *spec.shape[1:])
        parts.param[spec.fqn] = take(rows)
        parts.state[spec.fqn] = {key: take(rows if sharded else (numel,)) for key, sharded, numel in spec.state}
        if with_grads:
            parts.grad[spec.fqn] = take(rows)
    if cursor != flat.numel():
        raise ValueError(f"survive: the shard buffer of old rank {rank} has {flat.numel()} elements, its layout "
                         f"{cursor}: the ranks' models or optimizers differ")
    return parts


@dataclass
class FullState:
    """Every parameter and optimizer state tensor whole, by FQN (plain tensors), with the specs they came by."""

    param: dict[str, torch.Tensor]
    state: dict[str, dict[str, torch.Tensor]]
    specs: list[ShardSpec]


def full_state(shards: list[ShardParts], shard_specs: list[ShardSpec]) -> FullState:
    """Concatenate every old rank's rows (``shards`` in old rank order) into whole tensors."""
    whole = FullState({}, {}, shard_specs)
    for spec in shard_specs:
        whole.param[spec.fqn] = torch.cat([shard.param[spec.fqn] for shard in shards]).view(spec.shape)
        whole.state[spec.fqn] = {
            key: (torch.cat([shard.state[spec.fqn][key] for shard in shards]).view(spec.shape) if sharded
                  else shards[0].state[spec.fqn][key].clone())
            for key, sharded, _ in spec.state}
    return whole


def load_full_state(whole: FullState, model: torch.nn.Module, optimizer: torch.optim.Optimizer, rank: int,
                    world: int) -> None:
    """Put this rank's rows of ``whole`` into a freshly built ``model`` and its ``optimizer`` (W -> W')."""
    shard_specs = {spec.fqn: spec for spec in whole.specs}
    with torch.no_grad():
        for fqn, param in model.named_parameters():
            if fqn not in shard_specs or not isinstance(param, DTensor):
                raise ValueError(f"survive: the rebuilt model's parameter {fqn!r} is not one the old model sharded; "
                                 "build() must return the same model, sharded by fully_shard")
            rows = rank_slice(param.shape[0], world, rank)
            param.to_local().copy_(whole.param[fqn].narrow(0, rows.start, rows.size))
            optimizer.state[param] = {key: _shard_like(param, value, rows.start, rows.size) if sharded
                                      else value.clone()
                                      for (key, sharded, _), value in zip(shard_specs[fqn].state,
                                                                          whole.state[fqn].values(), strict=True)}


def _shard_like(param: DTensor, whole: torch.Tensor, start: int, size: int) -> torch.Tensor:
    """A DTensor sharded like ``param`` holding ``whole``'s rows ``[start, start + size)``."""
    shard = torch.zeros_like(param)
    assert isinstance(shard, DTensor)  # zeros_like keeps a DTensor's sharding
    shard.to_local().copy_(whole.narrow(0, start, size))
    return shard
