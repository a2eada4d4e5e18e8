"""ZeRO inside DDP's backward (``overlap_with_ddp=True``): the object the ZeRO DDP hooks drive.

:class:`Overlap` is built from what it needs (the parameters, the process
group, a factory for the local functional optimizer, the live param group for
options) and hands ZeroRedundancyOptimizer what it keeps (the partition and the
local optimizer, as an :class:`OverlapResult`) through a callback once DDP's
buckets are known; the hooks in ``ddp_zero_hook`` use only its public methods.

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
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

import tensorplay.distributed as dist
from tensorplay.distributed._comm import collectives
from tensorplay.distributed._sharding.layout import flat_layout
from tensorplay.distributed._sharding.partition import ddp_bucket_assignments
from tensorplay.distributed.optim.zero._chunked_step import functional_step
from tensorplay.distributed.optim.zero._sync import pack_as_views

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


@dataclass(frozen=True)
class OverlapResult:
    """What ZeroRedundancyOptimizer keeps once the partition is known.

    ``owned[r][0]``: the positions (in the single param group) that rank ``r``
    owns, in its local optimizer's order; ``optim``: this rank's local functional optimizer.
    """

    owned: list[list[list[int]]]
    optim: Any


@dataclass
class Overlap:
    """ZeRO's DDP-overlap mode: learns DDP's buckets, then updates and broadcasts each bucket inside backward.

    ``make_optim(params)`` builds the local functional optimizer over this
    rank's parameters; ``group()`` is the live param group whose options (an lr
    scheduler's lr ...) each update uses; ``ready(result)`` receives what the
    owner keeps once the partition is built.
    """

    params: list[torch.Tensor]
    process_group: Any
    make_optim: Callable[[list[torch.Tensor]], Any]
    group: Callable[[], dict[str, Any]]
    ready: Callable[[OverlapResult], None]
    status: OverlapStatus = OverlapStatus.UNINITIALIZED
    hooked: bool = False
    shard_buckets: bool = False
    bucket_params: list[list[torch.Tensor]] = field(default_factory=list)
    bucket_offsets: list[list[int]] = field(default_factory=list)
    pieces: dict[int, list[Piece]] = field(default_factory=dict)
    futures: dict[int, torch.futures.Future] = field(default_factory=dict)
    works: list[collectives.Pending] = field(default_factory=list)
    warned_step: bool = False
    optim: Any = None

    @property
    def num_buckets(self) -> int:
        return len(self.bucket_params)

    # ------------------------------------------------------------------ what the optimizer asks

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

    # ------------------------------------------------------------------ what the hooks ask

    def attach(self, name: str, shard_buckets: bool) -> None:
        """Register the one ZeRO hook (``name``) that drives this object."""
        if self.hooked:
            raise RuntimeError(f"{name}: this ZeroRedundancyOptimizer already has a ZeRO hook; register one per "
                               f"optimizer")
        self.hooked = True
        self.shard_buckets = shard_buckets

    def on_bucket(self, ddp: torch.nn.Module, bucket: dist.GradBucket, future: torch.futures.Future) -> bool:
        """Advance the warm-up state machine for ``bucket``; True (``future`` kept) once it is ready to step it."""
        if self.status != OverlapStatus.INITIALIZED and not self._observe(ddp, bucket):
            return False
        self.futures[bucket.index()] = future
        return True

    def _observe(self, ddp: torch.nn.Module, bucket: dist.GradBucket) -> bool:
        if not getattr(ddp, "_has_rebuilt_buckets", False):
            return False
        self.status = OverlapStatus.DDP_HAS_REBUILT_BUCKETS
        if bucket.index() == 0 and self.bucket_params:
            self._initialize()
            return True
        params = list(bucket.parameters())
        self.bucket_params.append(params)
        self.bucket_offsets.append(list(flat_layout([p.shape for p in params], world_size=1).offsets))
        return False

    def _initialize(self) -> None:
        """Partition by DDP bucket, pack each piece into a flat buffer, build the local functional optimizer."""
        world, rank = dist.get_world_size(self.process_group), dist.get_rank(self.process_group)
        numels = [[p.numel() for p in params] for params in self.bucket_params]
        params_per_rank: list[list[torch.Tensor]] = [[] for _ in range(world)]
        for a in ddp_bucket_assignments(numels, world, self.shard_buckets):
            params = self.bucket_params[a.bucket_index][a.start:a.stop]
            piece = Piece(a.bucket_index, a.start, a.stop, a.rank, params, pack_as_views(params),
                          len(params_per_rank[a.rank]))
            self.pieces.setdefault(a.bucket_index, []).append(piece)
            params_per_rank[a.rank].extend(params)
        for pieces in self.pieces.values():
            pieces.sort(key=lambda piece: piece.rank)
        position = {id(p): i for i, p in enumerate(self.params)}
        self.optim = self.make_optim(params_per_rank[rank])
        if not hasattr(self.optim, "param_groups"):
            self.optim.param_groups = [self.optim.param_group]
        self.status = OverlapStatus.INITIALIZED
        self.ready(OverlapResult([[[position[id(p)] for p in params]] for params in params_per_rank], self.optim))

    def _sync_options(self) -> None:
        """Send the options of the live param group (an lr scheduler's lr ...) to the functional optimizer."""
        options = getattr(self.optim, "defaults", None)
        if options is None:
            return
        for key, value in self.group().items():
            if key == "betas" and "beta1" in options:
                options["beta1"], options["beta2"] = value
            elif key != "params" and key in options:
                options[key] = value

    def update(self, bucket_index: int) -> None:
        """Step this rank's pieces of bucket ``bucket_index`` with its all-reduced gradients."""
        rank = dist.get_rank(self.process_group)
        own = [piece for piece in self.pieces[bucket_index] if piece.rank == rank]
        if not own:
            return
        reduced = self.futures[bucket_index].wait()
        reduced = reduced[0] if isinstance(reduced, (list, tuple)) else reduced
        self._sync_options()
        offsets = self.bucket_offsets[bucket_index]
        params = [param for piece in own for param in piece.params]
        gradients = [reduced[offsets[piece.start + i]:offsets[piece.start + i] + param.numel()].view_as(param)
                     for piece in own for i, param in enumerate(piece.params)]
        functional_step(self.optim, params, gradients)  # see [Note: chunked step]

    def broadcast(self, bucket_index: int) -> None:
        """Launch the broadcasts of bucket ``bucket_index``'s pieces, each from the rank that updated it."""
        for piece in self.pieces[bucket_index]:
            self.works.append(collectives.broadcast(piece.flat, piece.rank, self.process_group, async_op=True,
                                                    where=f"ZeRO overlapped step, parameters of rank {piece.rank}"))

    def finish_iteration(self) -> None:
        """Wait for every broadcast, so the next forward sees the updated parameters."""
        collectives.wait_all(self.works)
        self.futures.clear()
