"""``ShardedMatrixOptimizer``'s state keyed by FQN, for classic ``FullyShardedDataParallel`` models.

PyTorch's state-dict helpers (the fully_shard path of ``checkpoint.state_dict``) already save this
optimizer's state as it is. Classic FSDP's own optimizer state dict assumes state laid out like each
rank's piece of the flat shard, which Muon's whole momentum (held by the matrix's owner) and
Adafactor's whole row and column factors are not. Here each value is saved under its FQN as a whole
plain tensor: whole values as they are (an owner's Muon momentum on the owner only, or in a full state
dict on every rank, sent by the owner; Adafactor's factors, the same on every rank, which DCP writes
once); a value laid out like the parameter's piece (Adafactor's second moment of a vector) put together
over the shard group (an all-reduce of zero-filled tensors, vector-sized). Loading takes whole values as
they are (each owner keeps its matrices' state) and cuts each piece-laid-out one to this rank's piece, so
a checkpoint saved at any world size (or under fully_shard) loads.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from tensorplay.distributed._comm.collectives import all_reduce
from tensorplay.distributed._sharding.param_entries import param_entries

from ._factored import PIECE_KEYS, FactoredPiece, like_param
from ._full_state import check_loadable

if TYPE_CHECKING:
    from ._optimizer import ShardedMatrixOptimizer

_NOT_OPTIONS = ("params", "param_names")


def _fqns(model: nn.Module, optimizer: ShardedMatrixOptimizer) -> list[str]:
    """The FQN of each of ``optimizer``'s parameters, in ``param_groups`` order."""
    entries = param_entries(model)
    fqns = []
    for group in optimizer.param_groups:
        for param in group["params"]:
            if id(param) not in entries:
                raise ValueError(f"ShardedMatrixOptimizer holds a parameter of shape {tuple(param.shape)} that is "
                                 "not in the model; build it from this FSDP model's named_parameters()")
            fqns.append(entries[id(param)].fqns[0])
    return fqns


def _params(optimizer: ShardedMatrixOptimizer) -> list[torch.Tensor]:
    return [param for group in optimizer.param_groups for param in group["params"]]


def fqn_state_dict(model: nn.Module, optimizer: ShardedMatrixOptimizer, *, full: bool = False) -> dict[str, Any]:
    """``{"state": {fqn: {key: value}}, "param_groups": [{..., "params": [fqn, ...]}]}``, whole tensors (collective).

    ``full``: every matrix's state on every rank (the owner scheme's otherwise only on its owner).
    """
    fqns = _fqns(model, optimizer)
    params = _params(optimizer)
    held = optimizer.whole_states() if full else [optimizer.state.get(param, {}) for param in params]
    state: dict[str, dict[str, Any]] = {}
    for fqn, param, values in zip(fqns, params, held, strict=True):
        values = {key: _whole(optimizer.pieces[id(param)], value) if _laid_out_like_piece(optimizer, key) else value
                  for key, value in values.items()}
        if values:
            state[fqn] = values
    groups, cursor = [], 0
    for group in optimizer.param_groups:
        count = len(group["params"])
        options = {k: v for k, v in group.items() if k not in _NOT_OPTIONS}
        groups.append({**options, "params": fqns[cursor:cursor + count]})
        cursor += count
    return {"state": state, "param_groups": groups}


def load_fqn_state_dict(model: nn.Module, optimizer: ShardedMatrixOptimizer, saved: dict[str, Any]) -> None:
    """Load what :func:`fqn_state_dict` saved (at any world size) into ``optimizer``."""
    check_loadable(saved, "set_optimizer_state_dict")
    fqns = _fqns(model, optimizer)
    if len(saved["param_groups"]) != len(optimizer.param_groups):
        raise ValueError(f"set_optimizer_state_dict: {len(saved['param_groups'])} saved param groups, the "
                         f"ShardedMatrixOptimizer has {len(optimizer.param_groups)}")
    state = {}
    for index, (fqn, param) in enumerate(zip(fqns, _params(optimizer), strict=True)):
        if fqn in saved["state"]:
            state[index] = {key: _piece(optimizer.pieces[id(param)], value)
                            if _laid_out_like_piece(optimizer, key) else value
                            for key, value in saved["state"][fqn].items()}
    groups, cursor = [], 0
    for group, saved_group in zip(optimizer.param_groups, saved["param_groups"], strict=True):
        count = len(group["params"])
        groups.append({**{k: v for k, v in saved_group.items() if k not in _NOT_OPTIONS},
                       "params": list(range(cursor, cursor + count))})
        cursor += count
    optimizer.load_state_dict({"state": state, "param_groups": groups})


def _laid_out_like_piece(optimizer: ShardedMatrixOptimizer, key: str) -> bool:
    return optimizer.inner is None and key in PIECE_KEYS   # the factored Adafactor's second moment of a vector


def _whole(piece: FactoredPiece, value: torch.Tensor) -> torch.Tensor:
    """The whole tensor of which every rank of the piece's group holds ``value``'s piece."""
    local, source = piece.local(value), piece.source
    region = source.layout.holds[piece.rank]
    whole = local.new_zeros(source.shape)
    if piece.counts and region.numel:
        region.of(whole).copy_(local.reshape(region.sizes))
    if source.group is not None:
        all_reduce(whole, source.group, where=source.name)
    return whole


def _piece(piece: FactoredPiece, whole: torch.Tensor) -> torch.Tensor:
    """This rank's piece of the saved ``whole`` value, laid out like the parameter."""
    if isinstance(whole, torch.distributed.tensor.DTensor):
        whole = whole.full_tensor()
    local = piece.local(piece.source.param)
    region = piece.source.layout.holds[piece.rank]
    return like_param(piece, region.of(whole).reshape(local.shape).clone().to(local.device))
