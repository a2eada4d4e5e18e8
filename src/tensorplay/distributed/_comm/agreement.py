"""Agreement: every rank learns whether any rank failed, and which (and every rank's few check values).

[Note: agreement]
A rank that fails a check (a load, a plan, an optimizer step) and raises alone
leaves its peers blocked in the next collective. So each check ends in one
agreement: every rank says whether it failed and adds up to two int64 of its own
(a plan digest, a parameter count); every rank gets back the failed ranks and
every rank's values, so every rank raises, or none does. It is one control
all-gather (:func:`start_agreement`): all control collectives have one shape
and carry their tag, so a rank in another one (one rank loads a checkpoint, its
peer starts training) meets this one and every rank raises a
:class:`~.watch.CollectiveDivergence` naming what each rank was doing, where
collectives of different sizes would leave Gloo to abort a process. It is an
all-gather of ours, so it is watched and bounded by the group's timeout.
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from .collectives import Pending, all_gather_flat, backend_for
from .watch import CollectiveDivergence, GroupWatch, watch_for

__all__ = ["CONTROL_WIDTH", "Agreement", "PendingAgreement", "agree", "start_agreement"]

#: Every control collective gathers this many int64 per rank: a tag, a failure flag and two values. One shape
#: for all, so two ranks in different control collectives meet in the same transfer and see it.
CONTROL_WIDTH = 4
_VALUES = CONTROL_WIDTH - 2


@dataclass(frozen=True)
class Agreement:
    """What every rank of a group learned from one agreement (ranks are the group's)."""

    failed: list[int]  # the ranks that failed, in rank order
    values: list[list[int]]  # each rank's values, in rank order
    group: ProcessGroup | None = None

    def differing(self) -> list[int]:
        """The ranks whose values differ from rank 0's."""
        return [rank for rank, theirs in enumerate(self.values) if theirs != self.values[0]]

    def global_rank(self, rank: int) -> int:
        """``rank`` of the group as a rank of the default group (for messages)."""
        if self.group is None or self.group is dist.GroupMember.WORLD or not dist.is_initialized():
            return rank
        return dist.get_global_rank(self.group, rank)


@dataclass
class PendingAgreement:
    """An agreement in flight; :meth:`wait` finishes it (every rank must)."""

    tag: str
    pending: Pending | None
    gathered: torch.Tensor
    group: ProcessGroup | None

    def wait(self) -> Agreement:
        if self.pending is not None:
            self.pending.wait()
            self.pending = None
        rows = self.gathered.view(-1, CONTROL_WIDTH).cpu()
        code = _tag_code(self.tag)
        if bool((rows[:, 0] != code).any()):
            _raise_elsewhere(watch_for(self.group, lambda: backend_for(self.gathered, self.group)),
                             rows[:, 0].tolist(), code)
        failed = rows[:, 1].nonzero().flatten().tolist()
        return Agreement(failed, rows[:, 2:].tolist(), self.group)


def start_agreement(tag: str, failed: bool, group: ProcessGroup | None = None, *, values: Sequence[int] = (),
                    device: torch.device | None = None) -> PendingAgreement:
    """Start an agreement on ``tag`` (see [Note: agreement]): whether this rank ``failed``, and its ``values``
    (at most two int64). Collective: every rank of ``group`` calls it with the same ``tag``, then ``wait()``.

    ``device``: where the group's backend takes small tensors (the CPU for Gloo). Without an initialised
    process group, or in a group of one rank, it is this rank's own verdict, with no collective.
    """
    if len(values) > _VALUES:
        raise ValueError(f"start_agreement({tag!r}): at most {_VALUES} values, got {len(values)}")
    mine = torch.zeros(CONTROL_WIDTH, dtype=torch.int64, device=device)
    mine[0] = _tag_code(tag)
    mine[1] = int(failed)
    mine[2: 2 + len(values)] = torch.tensor(list(values), dtype=torch.int64)
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return PendingAgreement(tag, None, mine, group)
    gathered = mine.new_empty(dist.get_world_size(group) * CONTROL_WIDTH)
    pending = all_gather_flat(gathered, mine, group, async_op=True, where=tag)
    return PendingAgreement(tag, pending, gathered, group)


def agree(tag: str, failed: bool, group: ProcessGroup | None = None, *, values: Sequence[int] = (),
          device: torch.device | None = None) -> Agreement:
    """:func:`start_agreement` and wait for it: which ranks of ``group`` failed, and every rank's ``values``."""
    return start_agreement(tag, failed, group, values=values, device=device).wait()


def _tag_code(tag: str) -> int:
    return zlib.crc32(tag.encode())


def _raise_elsewhere(watch: GroupWatch | None, codes: list[int], code: int) -> None:
    """Every rank saw another tag: the watch names what each rank issued as this collective (its last record)."""
    others = [rank for rank, theirs in enumerate(codes) if theirs != code]
    error = RuntimeError(f"rank(s) {others} of the group issued another collective as this one")
    if watch is not None and watch.records:
        watch.diagnose(watch.records[-1], error, stalled_s=0.0, final=True)
    raise CollectiveDivergence(f"{error}; every rank must issue the same collectives in the same order") from None
