"""The two exchanges of the owner-per-matrix step: pieces to owners, updated pieces back.

See [Note: owner-per-matrix optimizer step] in ``_layout.py``. One
``all_to_all_single`` per direction moves every matrix of a group at once; it is
recorded by the group's collective watch (named by the matrices it moves) and its
wait is bounded like every other collective's.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tensorplay.distributed import ProcessGroup
from tensorplay.distributed._comm import collectives

from ._sources import MatrixSource


@dataclass
class GroupExchange:
    """The matrices of one shard group, each with its owner (a group rank) and, on the owner, its whole tensor."""

    group: ProcessGroup
    rank: int
    world_size: int
    sources: list[MatrixSource]
    owners: list[int]
    wholes: list[torch.Tensor]   # ND whole parameter on the owner; a meta tensor elsewhere

    def owned(self, present: list[bool], owner: int) -> list[int]:
        return [k for k, who in enumerate(self.owners) if who == owner and present[k]]

    def gather_to_owners(self, present: list[bool]) -> None:
        """Bring every present matrix's parameter and gradient pieces to its owner's whole tensors."""
        sends = []
        for owner in range(self.world_size):
            pieces: list[torch.Tensor] = []
            for k in self.owned(present, owner):
                source = self.sources[k]
                if source.layout.sends[self.rank]:
                    grad = source.param.grad
                    assert grad is not None or source.layout.holds[self.rank].numel == 0
                    pieces.append(source.local(source.param).detach().reshape(-1))
                    pieces.append(_piece_or_empty(source, grad, self.rank))
            sends.append(_cat(pieces, self._reference()))
        mine = self.owned(present, self.rank)
        sizes = [sum(2 * self.sources[k].layout.holds[peer].numel for k in mine
                     if self.sources[k].layout.sends[peer]) for peer in range(self.world_size)]
        received = self._all_to_all(sends, sizes, "to owners")
        for peer, chunk in enumerate(received):
            cursor = 0
            for k in mine:
                layout = self.sources[k].layout
                if not layout.sends[peer]:
                    continue
                region = layout.holds[peer]
                whole = self.wholes[k]
                if whole.grad is None:
                    whole.grad = torch.empty_like(whole)
                for target in (whole, whole.grad):
                    region.of(target).copy_(chunk[cursor: cursor + region.numel].view(region.sizes))
                    cursor += region.numel

    def scatter_from_owners(self, present: list[bool]) -> None:
        """Write each updated whole matrix's pieces back into every rank's local parameter."""
        mine = self.owned(present, self.rank)
        sends = [_cat([self.sources[k].layout.holds[peer].of(self.wholes[k]).reshape(-1) for k in mine],
                      self._reference()) for peer in range(self.world_size)]
        sizes = [sum(self.sources[k].layout.holds[self.rank].numel for k in self.owned(present, owner))
                 for owner in range(self.world_size)]
        received = self._all_to_all(sends, sizes, "from owners")
        with torch.no_grad():
            for owner, chunk in enumerate(received):
                cursor = 0
                for k in self.owned(present, owner):
                    local = self.sources[k].local(self.sources[k].param)
                    local.copy_(chunk[cursor: cursor + local.numel()].view(local.shape))
                    cursor += local.numel()

    def _reference(self) -> torch.Tensor:
        return self.sources[0].local(self.sources[0].param)

    def _all_to_all(self, sends: list[torch.Tensor], sizes: list[int], what: str) -> list[torch.Tensor]:
        flat_in = torch.cat(sends)
        flat_out = flat_in.new_empty(sum(sizes))
        # The watch compares a record's numel across ranks: record the matrix count, the same on every rank.
        collectives.all_to_all_single(flat_out, flat_in, sizes, [t.numel() for t in sends], self.group,
                                      where=f"{self.sources[0].name} ({what})", count=len(self.sources))
        return list(flat_out.split(sizes))


def _piece_or_empty(source: MatrixSource, grad: torch.Tensor | None, rank: int) -> torch.Tensor:
    if grad is None:  # an empty piece (classic FSDP leaves its gradient None)
        return source.local(source.param).detach().reshape(-1)[:0]
    return source.local(grad).reshape(-1).to(source.local(source.param).dtype)


def _cat(pieces: list[torch.Tensor], like: torch.Tensor) -> torch.Tensor:
    return torch.cat(pieces) if pieces else like.detach().new_empty(0)
