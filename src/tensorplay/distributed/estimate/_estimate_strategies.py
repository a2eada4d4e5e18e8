"""One rank's memory through a step, per strategy: the meta timeline plus what the layout keeps.

[Note: composing the step]
``Trace.live[i]`` is the activations and temporaries after op ``i`` of one
micro-batch's forward and backward. Each strategy adds, per unit, intervals of
the timeline during which it holds bytes:

* resident parameters (sharded: each parameter's padded dim-0 shard for
  fully_shard, the unit's padded flat shard for classic FSDP, from
  ``_sharding.layout``; whole for DDP and ZeRO), all step long;
* gathered parameters (sharded strategies), from a unit's forward until its
  end (resharded) or its backward's end, and again through its backward; the
  next unit's all-gather is issued before the current one's backward runs
  (backward prefetch);
* each gradient as it arrives (whole, in the compute dtype) until its unit's
  reduction; the reduction's buffers at that moment; then the resident
  gradient (sharded for the sharded strategies) to the end of the step;
* DDP's buckets (one copy of the gradients) and the optimizer state, all step.

The optimizer step is one more point: resident parameters, gradients, state,
and the optimizer's temporaries for its largest local parameter.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from math import prod

import torch

from tensorplay.distributed._sharding.layout import chunk_size, flat_layout
from tensorplay.distributed._sharding.partition import sorted_greedy_partition

from ._estimate_layouts import Layout
from ._estimate_optim import OptimizerCost
from ._estimate_trace import Trace, UnitTrace


@dataclass(frozen=True)
class RankMemory:
    """One rank's predicted memory in bytes: what it keeps, and the peak with its parts and place."""

    params: int  # resident (sharded or whole), on the device unless offloaded
    grads: int  # resident after backward
    optimizer_state: int
    activations: int  # at the peak
    comm_buffers: int  # at the peak: gathered parameters, unreduced gradients, reduction and bucket buffers
    offloaded: int  # on the host (CPU offload), not in the peak
    peak: int
    where: str
    phase_peaks: dict[str, int] = field(default_factory=dict)  # forward, backward, optimizer step

    @property
    def model_states(self) -> int:
        return self.params + self.grads + self.optimizer_state


def _size(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype, device="meta").element_size()


def _dim0_shard_numel(shape: torch.Size, shards: int) -> int:
    return chunk_size(shape[0], shards) * prod(shape[1:]) if len(shape) else 1  # a scalar is replicated


@dataclass
class _Timeline:
    """Bytes added to spans of the trace's ops (difference array), and the always-held bytes."""

    n: int

    def __post_init__(self) -> None:
        self.delta = [0] * (self.n + 1)
        self.comm_delta = [0] * (self.n + 1)

    def add(self, start: int, end: int, nbytes: int, comm: bool = True) -> None:
        """Hold ``nbytes`` from op ``start`` through op ``end`` (inclusive)."""
        start, end = max(start, 0), min(end, self.n - 1)
        if start > end:
            return
        for delta in (self.delta, self.comm_delta) if comm else (self.delta,):
            delta[start] += nbytes
            delta[end + 1] -= nbytes

    def running(self, delta: list[int]) -> list[int]:
        out, acc = [], 0
        for value in delta[:-1]:
            acc += value
            out.append(acc)
        return out


def predict(trace: Trace, layout: Layout, world_size: int, rank: int, cost: OptimizerCost,
            device: str = "cuda") -> RankMemory:
    """Rank ``rank``'s memory for one step of ``layout`` over ``world_size`` ranks on ``device`` (a type).

    See [Note: composing the step]. On the CPU both FSDPs reduce-scatter through the shared-memory
    transport straight from the gradients (no rank-major input buffer).
    """
    units = trace.units
    shards = layout.shard_size(world_size)
    pbytes = _size(trace.param_dtype)
    compute = _size(layout.param_dtype) if layout.param_dtype else pbytes
    reduce = _size(layout.reduce_dtype) if layout.reduce_dtype else compute
    timeline = _Timeline(len(trace.live))
    last = len(trace.live) - 1
    local_numels: list[int] = []  # the parameters this rank's optimizer updates
    step_numels: list[int] | None = None  # what the optimizer's temporaries scale with (default: local_numels)
    step_extra = 0  # bytes held while the optimizer steps beyond parameters, gradients, state and temporaries
    kept_params = kept_grads = 0
    sharded = layout.strategy in ("fully_shard", "hsdp") or layout.strategy.startswith("fsdp_")
    if sharded:
        flat = layout.strategy.startswith("fsdp_")
        for index, unit in enumerate(units):
            if not unit.shapes:
                continue
            shard = flat_layout(unit.shapes, shards).shard_numel if flat else \
                sum(_dim0_shard_numel(s, shards) for s in unit.shapes)
            local_numels += [shard] if flat else [_dim0_shard_numel(s, shards) for s in unit.shapes]
            kept_params += shard * pbytes
            kept_grads += shard * pbytes
            gathered = shard * shards * compute
            # Classic FULL_SHARD over one rank runs as NO_SHARD (PyTorch's rule): nothing is freed after forward.
            reshard = layout.reshards and index > 0 and not (layout.strategy == "fsdp_full_shard" and shards == 1)
            end_of_forward = unit.fwd_end if reshard else unit.bwd_end
            start = unit.fwd_start if flat or index == 0 else _forward_prefetch_start(unit, units)
            timeline.add(start, end_of_forward, gathered)
            if reshard:
                timeline.add(_prefetch_start(unit, units), unit.bwd_end, gathered)
            if layout.grad_accum == 1:  # else held all step by _accumulated
                _unsharded_grads(timeline, unit, compute)
            if flat and reduce != compute:  # classic FSDP casts the unsharded gradient to reduce_dtype first
                timeline.add(unit.bwd_end, unit.bwd_end, shard * shards * reduce)
            if device != "cpu":  # the reduce-scatter's rank-major input
                timeline.add(unit.bwd_end, unit.bwd_end, shard * shards * reduce)
            if not layout.cpu_offload:  # the sharded gradient (offloaded: on the host)
                timeline.add(unit.bwd_end, last, shard * pbytes, comm=False)
    else:
        numels = [s.numel() for unit in units for s in unit.shapes]
        kept_params = kept_grads = sum(numels) * compute  # a model cast to param_dtype keeps it in that dtype
        if layout.strategy.startswith("zero"):
            owned = sorted_greedy_partition([numels], world_size)[rank][0]
            local_numels = [numels[i] for i in owned]
            staged, step_numels = _zero_buffers(layout, numels, local_numels, device)
            timeline.add(0, last, staged * compute)
            step_extra = staged * compute
        else:
            local_numels = numels
        for unit in units if layout.grad_accum == 1 else ():  # else held all step by _accumulated
            for shape, released in zip(unit.shapes, unit.grad_released, strict=False):
                timeline.add(released, last, shape.numel() * compute, comm=False)
        timeline.add(0, last, kept_grads)  # DDP's buckets: a copy of every gradient
    state = cost.state_bytes(local_numels)
    if layout.param_dtype is not None and not sharded:  # the optimizer keeps fp32 master weights of its part
        state += 4 * sum(local_numels)
    resident = (0 if layout.cpu_offload else kept_params + state)
    always = resident + _accumulated(units, layout, kept_grads, compute)
    totals = [a + b + always for a, b in zip(trace.live, timeline.running(timeline.delta), strict=True)]
    comm = timeline.running(timeline.comm_delta)
    step_total = resident + step_extra + (0 if layout.cpu_offload else kept_grads) + \
        (0 if layout.cpu_offload else cost.step_bytes(step_numels or local_numels)) + \
        (kept_grads if layout.strategy in ("ddp", "zero", "zero_bucket_view") else 0)
    i = max(range(len(totals)), key=totals.__getitem__)
    if step_total > totals[i]:
        peak, where, acts, comm_at = step_total, "optimizer step", 0, 0
    else:
        peak, where, acts, comm_at = totals[i], trace.where[i], trace.live[i], comm[i]
    split = trace.backward_start
    phases = {"forward": max(totals[:split], default=0), "backward": max(totals[split:], default=0),
              "optimizer step": step_total}
    offloaded = kept_params + kept_grads + state if layout.cpu_offload else 0
    return RankMemory(params=kept_params, grads=kept_grads, optimizer_state=state, activations=acts,
                      comm_buffers=comm_at, offloaded=offloaded, peak=peak, where=where,
                      phase_peaks=phases)


def _zero_buffers(layout: Layout, numels: list[int], local: list[int], device: str) -> tuple[int, list[int]]:
    """Our ZeRO's extra elements held all step, and the sizes its optimizer's temporaries scale with.

    Without the bucket view, parameters of at most ``SMALL_NUMEL`` elements travel packed in one
    buffer (every rank's); with it, a copy of the rank's parameters that are stepped in merged chunks
    (measured on our ZeRO; the rank's whole bucket when nothing is chunked). On the CPU an elementwise optimizer steps
    pieces of at most ``CHUNK_NUMEL`` elements (see [Note: chunked step]), so its temporaries are that big.
    """
    from tensorplay.distributed.optim._zero_chunked_step import CHUNK_NUMEL
    from tensorplay.distributed.optim._zero_sync import SMALL_NUMEL

    chunk = CHUNK_NUMEL if device == "cpu" and CHUNK_NUMEL is not None else None
    if layout.strategy == "zero":
        staged, pieces = sum(n for n in numels if n <= SMALL_NUMEL), local
    else:  # measured: the parameters stepped in merged chunks (those under a chunk) are held once more
        staged, pieces = sum(n for n in local if chunk is None or n < chunk), [sum(local)]
    if chunk is not None:
        pieces = [min(n, chunk) for n in pieces]
    return staged, pieces


def _accumulated(units: list[UnitTrace], layout: Layout, kept_grads: int, compute: int) -> int:
    """Gradients held from earlier micro-batches while the last one runs (gradient accumulation without sync):
    the whole gradients for DDP and ZeRO, every unit's unsharded gradients for the sharded strategies."""
    if layout.grad_accum == 1:
        return 0
    if layout.strategy in ("ddp", "zero", "zero_bucket_view", "fsdp_no_shard"):
        return kept_grads
    return sum(unit.numel for unit in units) * compute


def _forward_prefetch_start(unit: UnitTrace, units: list[UnitTrace]) -> int:
    """When fully_shard issues ``unit``'s forward all-gather: as the unit before it (not the root) starts forward."""
    earlier = [u.fwd_start for u in units[1:] if u is not unit and 0 <= u.fwd_start < unit.fwd_start]
    return min(max(earlier, default=unit.fwd_start) + 1, unit.fwd_start)


def _prefetch_start(unit: UnitTrace, units: list[UnitTrace]) -> int:
    """When ``unit``'s backward all-gather is issued: as the unit run before it in backward starts its backward."""
    earlier = [u.bwd_start for u in units if u is not unit and 0 <= u.bwd_start < unit.bwd_start]
    # One op later: the unit before it has been resharded by then (its backward ends at that same op).
    return min(max(earlier, default=unit.bwd_start) + 1, unit.bwd_start)


def _unsharded_grads(timeline: _Timeline, unit: UnitTrace, compute: int) -> None:
    for shape, released in zip(unit.shapes, unit.grad_released, strict=False):
        timeline.add(released, unit.bwd_end, shape.numel() * compute)
