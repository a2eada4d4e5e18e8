"""ZeRO inside DDP's backward (``overlap_with_ddp=True``): the state the ZeRO DDP hooks drive.

The partition follows DDP's gradient buckets, which DDP only settles after its
first iteration, so the hooks go through three states, as PyTorch's do:

    UNINITIALIZED            DDP has not rebuilt its buckets: nothing happens.
    DDP_HAS_REBUILT_BUCKETS  one iteration records each bucket's parameters.
    INITIALIZED              at the next bucket 0: partition, buffers, local
                             functional optimizer; from then on every bucket's
                             update and broadcast run inside backward.

So the first two iterations update nothing (three with ``static_graph=True``).

[Note: collective order on Gloo]
Every rank must issue its collectives in the same order. DDP calls the hooks
in bucket order on the backward thread, but all-reduce completion callbacks run
on the backend's worker threads in whatever order the work finishes; issuing
the broadcasts from such callbacks (what PyTorch's interleaved hook does) lets
two ranks disagree on the order, which hangs Gloo. Here every update and
broadcast is issued from a hook call, on the backward thread: bucket ``i``'s
when bucket ``i + 1`` is handed over (interleaved) or all at the last bucket.
"""

from __future__ import annotations

import enum
import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from tensorplay.distributed._shard.layout import flat_layout
from tensorplay.distributed._shard.partition import ddp_bucket_assignments
from tensorplay.distributed.optim._zero_sync import pack_as_views, wait_all

if TYPE_CHECKING:
    from tensorplay.distributed.optim.zero_redundancy_optimizer import (
        ZeroRedundancyOptimizer,
    )

logger = logging.getLogger(__name__)


class OverlapStatus(enum.IntEnum):
    UNINITIALIZED = 0
    DDP_HAS_REBUILT_BUCKETS = 1
    INITIALIZED = 2


@dataclass
class Piece:
    """Parameters ``[start, stop)`` of DDP bucket ``bucket_index``, updated by ``rank``.

    ``flat`` holds them end to end (they are views of it); ``local_offset`` is
    where they start in the owner's local optimizer.
    """

    bucket_index: int
    start: int
    stop: int
    rank: int
    params: list[torch.Tensor]
    flat: torch.Tensor
    local_offset: int


@dataclass
class Overlap:
    """What a ZeroRedundancyOptimizer in DDP-overlap mode knows about DDP's buckets."""

    status: OverlapStatus = OverlapStatus.UNINITIALIZED
    hooked: bool = False
    shard_buckets: bool = False
    bucket_params: list[list[torch.Tensor]] = field(default_factory=list)
    bucket_offsets: list[list[int]] = field(default_factory=list)
    pieces: dict[int, list[Piece]] = field(default_factory=dict)
    futures: dict[int, torch.futures.Future] = field(default_factory=dict)
    works: list[dist.Work] = field(default_factory=list)
    warned_step: bool = False

    @property
    def num_buckets(self) -> int:
        return len(self.bucket_params)

    def step_outside_hook(self) -> None:
        if not self.hooked:
            raise RuntimeError(
                "ZeroRedundancyOptimizer(overlap_with_ddp=True) updates parameters inside DDP's backward, but no "
                "ZeRO hook is registered: call ddp.register_comm_hook(None, hook_with_zero_step(allreduce_hook, "
                "ddp, zero)) (from tensorplay.distributed.algorithms.ddp_comm_hooks.ddp_zero_hook) before training")
        if not self.warned_step:
            logger.warning("step() does nothing with overlap_with_ddp=True: the DDP hook already stepped")
            self.warned_step = True

    def check_ready(self, what: str) -> None:
        if self.status != OverlapStatus.INITIALIZED:
            hint = "" if self.hooked else " (and no ZeRO hook is registered on the DDP model)"
            raise RuntimeError(
                f"{what} is not available yet: with overlap_with_ddp=True the optimizer is built once DDP has "
                f"settled its buckets, during the third training iteration{hint}")


def state_of(zero: ZeroRedundancyOptimizer) -> Overlap:
    """``zero``'s overlap state (it exists once ``zero`` was built with ``overlap_with_ddp=True``)."""
    assert zero._overlap is not None, "ZeroRedundancyOptimizer was built without overlap_with_ddp=True"
    return zero._overlap


def observe(zero: ZeroRedundancyOptimizer, ddp: torch.nn.Module, bucket: dist.GradBucket) -> bool:
    """Advance the warm-up state machine for ``bucket``; True once ``zero`` is ready to step it."""
    overlap = state_of(zero)
    if overlap.status == OverlapStatus.INITIALIZED:
        return True
    if not getattr(ddp, "_has_rebuilt_buckets", False):
        return False
    overlap.status = OverlapStatus.DDP_HAS_REBUILT_BUCKETS
    if bucket.index() == 0 and overlap.bucket_params:
        initialize(zero)
        return True
    params = list(bucket.parameters())
    overlap.bucket_params.append(params)
    overlap.bucket_offsets.append(list(flat_layout([p.shape for p in params], world_size=1).offsets))
    return False


def initialize(zero: ZeroRedundancyOptimizer) -> None:
    """Partition by DDP bucket, pack each piece into a flat buffer, build the local functional optimizer."""
    overlap = state_of(zero)
    numels = [[p.numel() for p in params] for params in overlap.bucket_params]
    assignments = ddp_bucket_assignments(numels, zero.world_size, overlap.shard_buckets)
    params_per_rank: list[list[torch.Tensor]] = [[] for _ in range(zero.world_size)]
    for a in assignments:
        params = overlap.bucket_params[a.bucket_index][a.start:a.stop]
        piece = Piece(a.bucket_index, a.start, a.stop, a.rank, params, pack_as_views(params),
                      len(params_per_rank[a.rank]))
        overlap.pieces.setdefault(a.bucket_index, []).append(piece)
        params_per_rank[a.rank].extend(params)
    for pieces in overlap.pieces.values():
        pieces.sort(key=lambda piece: piece.rank)
    position = {id(p): i for i, p in enumerate(zero.param_groups[0]["params"])}
    zero._owned = [[[position[id(p)] for p in params]] for params in params_per_rank]
    zero.optim = zero._functional_from(zero._optim_class, params_per_rank[zero.rank], **zero._optim_defaults)
    if not hasattr(zero.optim, "param_groups"):
        zero.optim.param_groups = [zero.optim.param_group]
    overlap.status = OverlapStatus.INITIALIZED


def sync_options(zero: ZeroRedundancyOptimizer) -> None:
    """Send the options on ``zero.param_groups`` (an lr scheduler's lr ...) to the functional optimizer."""
    options = getattr(zero.optim, "defaults", None)
    if options is None:
        return
    for key, value in zero.param_groups[0].items():
        if key == "betas" and "beta1" in options:
            options["beta1"], options["beta2"] = value
        elif key != "params" and key in options:
            options[key] = value


def update_and_broadcast(zero: ZeroRedundancyOptimizer, bucket_index: int) -> None:
    """Step this rank's pieces of bucket ``bucket_index`` (after its all-reduce) and launch the bucket's broadcasts."""
    overlap = state_of(zero)
    pieces = overlap.pieces[bucket_index]
    own = [piece for piece in pieces if piece.rank == zero.rank]
    if own:
        reduced = overlap.futures[bucket_index].wait()
        reduced = reduced[0] if isinstance(reduced, (list, tuple)) else reduced
        sync_options(zero)
        gradients: list[torch.Tensor | None] = [None] * len(zero.optim.param_groups[0]["params"])
        offsets = overlap.bucket_offsets[bucket_index]
        for piece in own:
            for i, param in enumerate(piece.params):
                start = offsets[piece.start + i]
                gradients[piece.local_offset + i] = reduced[start:start + param.numel()].view_as(param)
        zero.optim.step(gradients)
    for piece in pieces:
        overlap.works.append(dist.broadcast(piece.flat, group=zero.process_group, group_src=piece.rank,
                                            async_op=True))


def finish_iteration(zero: ZeroRedundancyOptimizer) -> None:
    """Wait for every broadcast, so the next forward sees the updated parameters."""
    overlap = state_of(zero)
    wait_all(overlap.works)
    overlap.futures.clear()
