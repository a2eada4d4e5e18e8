"""The buddy copy: each rank's shard (parameters, optimizer state, reduced gradients) in the next rank's memory.

[Note: the buddy copy]
Before the commit of step n, rank r sends its whole shard as it stands (the state after n steps, and the reduced
gradient of step n) to its buddy ``(r + 1) mod W`` and receives rank ``r - 1``'s (one all-to-all in which each
rank sends one piece and receives one: bytes flat in W). The commit's agreement comes after it, so a committed
step means every copy of it arrived. A copy is tagged with the step it precedes: when the survivors settle on
step n, the copy is used as it is; when they settle on n + 1 (the step was committed), the buddy replays step
n's optimizer update on it (the same optimizer class over the copy's tensors, with the hyperparameters the copy
carries: each param group's as they stood when it was sent, so a schedule that changes the learning rate after
step n's commit does not leak into step n's replay). A receive that fails keeps the previous copy (it lands in a
new buffer), which is then one step behind and replayed once. The cost per rank and step: one shard of
parameters, optimizer state and gradients sent, and that much host memory held (twice while a new copy arrives).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from .._comm.collectives import all_to_all_single
from .errors import ShardsLost
from .shard_state import ShardParts, ShardSpec, pack_shard, specs, unpack_shard

__all__ = ["BuddyCopy", "buddy_of"]


def buddy_of(rank: int, world: int) -> int:
    """The rank that holds ``rank``'s copy."""
    return (rank + 1) % world


@dataclass(frozen=True)
class ShardCopy:
    """The shard of old rank ``owner`` of ``world`` ranks before the optimizer update of step ``step``."""

    owner: int
    world: int
    step: int
    specs: list[ShardSpec]
    flat: torch.Tensor
    hyperparameters: list[dict[str, Any]]  # each param group's, but its params, when the copy was sent


class BuddyCopy:
    """This rank's side of the buddy copy: it sends its shard and holds its left neighbour's."""

    held: ShardCopy | None

    def __init__(self) -> None:
        self.held = None

    def refresh(self, step: int, model: torch.nn.Module, optimizer: torch.optim.Optimizer, rank: int,
                world: int) -> None:
        """Send this rank's shard (with its reduced gradients) to its buddy; keep the left neighbour's."""
        if world == 1:
            return
        shard_specs = specs(model, optimizer)
        mine = pack_shard(model, optimizer, with_grads=True)
        left, right = (rank - 1) % world, buddy_of(rank, world)
        theirs = mine.new_empty(sum(spec.numel(left, world, with_grads=True) for spec in shard_specs))
        sent, received = [0] * world, [0] * world
        sent[right], received[left] = mine.numel(), theirs.numel()
        all_to_all_single(theirs, mine, received, sent, where="survive buddy copy", count=world).wait()
        self.held = ShardCopy(left, world, step, shard_specs, theirs, _hyperparameters(optimizer))

    def restore(self, settled_step: int, optimizer: torch.optim.Optimizer, fqns: dict[int, str]) -> ShardParts:
        """The held shard at ``settled_step`` completed steps (replayed once if needed)."""
        held = self.held
        assert held is not None  # the caller checked that this rank holds the copy it asks for
        parts = unpack_shard(held.flat, held.specs, held.owner, held.world, with_grads=True)
        if settled_step == held.step + 1:
            parts.state = _replay(parts, optimizer, fqns, held.hyperparameters)
        elif settled_step != held.step:
            raise ShardsLost(f"the copy of old rank {held.owner}'s shard precedes step {held.step}, the survivors "
                             f"settled on step {settled_step}: it is too old to restore")
        parts.grad = {}
        return parts


def _hyperparameters(optimizer: torch.optim.Optimizer) -> list[dict[str, Any]]:
    """Each param group's settings but its params, as they stand now (tensor-valued ones cloned)."""
    return [{key: value.clone() if isinstance(value, torch.Tensor) else value
             for key, value in group.items() if key != "params"} for group in optimizer.param_groups]


def _replay(parts: ShardParts, optimizer: torch.optim.Optimizer, fqns: dict[int, str],
            hyperparameters: list[dict[str, Any]]) -> dict[str, dict[str, torch.Tensor]]:
    """Take the optimizer update of the copy's step on its tensors (parameters in place) and return the
    optimizer state after it: ``optimizer``'s class, each parameter of group i with ``hyperparameters[i]``
    (the copy's; ``fqns``: parameter id -> FQN in the live model). The first step creates state the copy had
    none of."""
    groups, params = [], {}
    for group, settings in zip(optimizer.param_groups, hyperparameters, strict=True):
        members = []
        for live in group["params"]:
            fqn = fqns[id(live)]
            param = params[fqn] = torch.nn.Parameter(parts.param[fqn], requires_grad=True)
            param.grad = parts.grad[fqn]
            members.append(param)
        groups.append({**settings, "params": members})
    replica = type(optimizer)(groups)  # type: ignore[call-arg]  # torch's optimizers take the groups alone
    for fqn, param in params.items():
        if parts.state[fqn]:
            replica.state[param] = dict(parts.state[fqn])
    replica.step()  # updates the parameters' views into the copy's buffer in place
    return {fqn: dict(sorted(replica.state[param].items())) for fqn, param in params.items()}
