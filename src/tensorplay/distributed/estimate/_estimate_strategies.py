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
and the optimizer's temporaries for its largest local parameter. With the
optimizer applied in backward there is no such point: each unit's (bucket's)
parameters step inside backward, their temporaries added at that op, and the
reduced gradients are held only until then (``_estimate_in_backward``).

[Note: classic FSDP's reduce-dtype cast]
With a ``reduce_dtype`` other than the compute dtype, classic FSDP stages the
views' gradients straight into its reduce-scatter, cast on the way, as in its
own dtype (``FlatParamHandle._stages_view_grads``): nothing full-size is added.
Accumulating without sync, the last micro-batch adds into the flat gradient
kept from the earlier ones (held by ``_accumulated``), which the reduction then
casts to ``reduce_dtype`` whole: that cast is alive at the unit's last
backward op.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from math import prod

import torch

from tensorplay.distributed._sharding.layout import chunk_size, flat_layout
from tensorplay.distributed._sharding.partition import sorted_greedy_partition

from . import _estimate_in_backward as in_backward
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
    #: the most parameter bytes held gathered (unsharded, in the compute dtype) at once; 0 when never sharded
    gathered_params: int = 0

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


@dataclass
class _Held:
    """What a layout holds for one rank, filled in per unit: the timelines and the totals."""

    n: int
    local_numels: list[int] = field(default_factory=list)  # the parameters this rank's optimizer updates
    step_numels: list[int] | None = None  # what the optimizer's temporaries scale with (default: local_numels)
    step_extra: int = 0  # bytes held while the optimizer steps beyond parameters, gradients, state, temporaries
    kept_params: int = 0
    kept_grads: int = 0  # resident after backward
    whole_grads: int = 0  # one whole copy of the gradients (DDP, ZeRO), held across accumulated micro-batches
    step_temps: dict[int, int] = field(default_factory=dict)  # optimizer steps in backward: op -> temporaries
    step_units: dict[int, list[str]] = field(default_factory=dict)  # op -> the units (buckets) stepping there

    def __post_init__(self) -> None:
        self.timeline = _Timeline(self.n)
        self.gathered = _Timeline(self.n)  # gathered parameters only (``RankMemory.gathered_params``)

    def gather(self, start: int, end: int, nbytes: int) -> None:
        self.timeline.add(start, end, nbytes)
        self.gathered.add(start, end, nbytes)

    def step_in_backward(self, op: int, temporaries: int, name: str) -> None:
        """Parameters step at ``op`` one optimizer after another: the largest temporaries count."""
        op = min(op, self.n - 1)
        self.step_temps[op] = max(self.step_temps.get(op, 0), temporaries)
        self.step_units.setdefault(op, []).append(name)


def predict(trace: Trace, layout: Layout, world_size: int, rank: int, cost: OptimizerCost,
            device: str = "cuda") -> RankMemory:
    """Rank ``rank``'s memory for one step of ``layout`` over ``world_size`` ranks on ``device`` (a type).

    See [Note: composing the step]. On the CPU both FSDPs reduce-scatter through the shared-memory
    transport straight from the gradients (no rank-major input buffer).
    """
    held = _Held(len(trace.live))
    sharded = layout.strategy in ("fully_shard", "hsdp") or layout.strategy.startswith("fsdp_")
    if sharded:
        _hold_sharded(held, trace, layout, world_size, rank, cost, device)
    else:
        _hold_replicated(held, trace, layout, world_size, rank, cost, device)
    for op, temporaries in held.step_temps.items():
        held.timeline.add(op, op, temporaries, comm=False)
    state = cost.state_bytes(held.local_numels)
    if layout.param_dtype is not None and not sharded:  # the optimizer keeps fp32 master weights of its part
        state += 4 * sum(held.local_numels)
    return _rank_memory(trace, layout, held, state, cost)


def _rank_memory(trace: Trace, layout: Layout, held: _Held, state: int, cost: OptimizerCost) -> RankMemory:
    """The peak over the step's ops (and the optimizer step after backward, unless it runs in backward)."""
    resident = 0 if layout.cpu_offload else held.kept_params + state
    always = resident + _accumulated(trace.units, layout, held, trace.param_dtype)
    totals = [a + b + always for a, b in zip(trace.live, held.timeline.running(held.timeline.delta), strict=True)]
    comm = held.timeline.running(held.timeline.comm_delta)
    split = trace.backward_start
    phases = {"forward": max(totals[:split], default=0), "backward": max(totals[split:], default=0)}
    if not layout.optim_in_backward:
        phases["optimizer step"] = resident + held.step_extra + (0 if layout.cpu_offload else held.kept_grads) + \
            (0 if layout.cpu_offload else cost.step_bytes(held.step_numels or held.local_numels)) + \
            (held.kept_grads if layout.strategy in ("ddp", "zero", "zero_bucket_view") else 0)
    i = max(range(len(totals)), key=totals.__getitem__)
    if phases.get("optimizer step", 0) > totals[i]:
        peak, where, acts, comm_at = phases["optimizer step"], "optimizer step", 0, 0
    else:
        peak, where, acts, comm_at = totals[i], _where(trace, held, i), trace.live[i], comm[i]
    offloaded = held.kept_params + held.kept_grads + state if layout.cpu_offload else 0
    return RankMemory(params=held.kept_params, grads=held.kept_grads, optimizer_state=state, activations=acts,
                      comm_buffers=comm_at, offloaded=offloaded, peak=peak, where=where, phase_peaks=phases,
                      gathered_params=max(held.gathered.running(held.gathered.delta), default=0))


def _where(trace: Trace, held: _Held, op: int) -> str:
    names = held.step_units.get(op)
    if not names:
        return trace.where[op]
    listed = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
    return f"{trace.where[op]}, optimizer step in backward ({listed})"


def _hold_sharded(held: _Held, trace: Trace, layout: Layout, world_size: int, rank: int, cost: OptimizerCost,
                  device: str) -> None:
    """fully_shard, HSDP and classic FSDP: shards resident, units gathered, gradients reduced per unit."""
    units, last = trace.units, len(trace.live) - 1
    shards = layout.shard_size(world_size)
    pbytes = _size(trace.param_dtype)
    compute = _size(layout.param_dtype) if layout.param_dtype else pbytes
    reduce = _size(layout.reduce_dtype) if layout.reduce_dtype else compute
    grad_size = reduce if layout.keep_low_precision_grads else pbytes  # the sharded gradient's dtype
    flat = layout.strategy.startswith("fsdp_")
    for index, unit in enumerate(units):
        if not unit.shapes:
            continue
        shard = flat_layout(unit.shapes, shards).shard_numel if flat else \
            sum(_dim0_shard_numel(s, shards) for s in unit.shapes)
        stepped = [shard] if flat else [_dim0_shard_numel(s, shards) for s in unit.shapes]
        if flat and layout.optim_in_backward:  # use_orig_params=True: the original parameters' pieces step
            stepped = in_backward.orig_param_pieces(unit.shapes, shards, rank)
        held.local_numels += stepped
        held.kept_params += shard * pbytes
        if not layout.optim_in_backward or in_backward.keeps_flat_grad(layout):
            held.kept_grads += shard * grad_size
        _hold_gathered(held, unit, units, index, layout, shards, shard * shards * compute)
        if layout.grad_accum == 1 or layout.optim_in_backward:  # else held all step by _accumulated
            _unsharded_grads(held.timeline, unit, compute)
        staged = layout.grad_accum == 1 or layout.optim_in_backward  # else it adds into the kept flat gradient
        if flat and reduce != compute and not staged:  # see [Note: classic FSDP's reduce-dtype cast]
            held.timeline.add(unit.bwd_end, unit.bwd_end, shard * shards * reduce)
        if device != "cpu":  # the reduce-scatter's rank-major input
            held.timeline.add(unit.bwd_end, unit.bwd_end, shard * shards * reduce)
        if layout.cpu_offload:  # the sharded gradient and the optimizer step are on the host
            continue
        for start, end in in_backward.sharded_grad_spans(index, units, layout, last):
            held.timeline.add(start, end, shard * grad_size, comm=False)
        if layout.optim_in_backward:  # one optimizer per parameter: the largest one's temporaries
            held.step_in_backward(in_backward.steps_at(index, units, layout, last),
                                  cost.step_bytes([max(stepped, default=0)]), unit.name)


def _hold_gathered(held: _Held, unit: UnitTrace, units: list[UnitTrace], index: int, layout: Layout, shards: int,
                   gathered: int) -> None:
    """A unit's gathered parameters: from its forward (prefetched) to its end, and again through its backward."""
    flat = layout.strategy.startswith("fsdp_")
    # Classic FULL_SHARD over one rank runs as NO_SHARD (PyTorch's rule): nothing is freed after forward.
    reshard = layout.reshards and index > 0 and not (layout.strategy == "fsdp_full_shard" and shards == 1)
    end_of_forward = unit.fwd_end if reshard else unit.bwd_end
    start = unit.fwd_start if flat or index == 0 else _forward_prefetch_start(unit, units)
    held.gather(start, end_of_forward, gathered)
    if reshard:
        held.gather(_prefetch_start(unit, units), unit.bwd_end, gathered)


def _hold_replicated(held: _Held, trace: Trace, layout: Layout, world_size: int, rank: int, cost: OptimizerCost,
                     device: str) -> None:
    """DDP and ZeRO: the whole model and its gradients on every rank, DDP's buckets a second copy."""
    units, last = trace.units, len(trace.live) - 1
    compute = _size(layout.param_dtype) if layout.param_dtype else _size(trace.param_dtype)
    numels = [s.numel() for unit in units for s in unit.shapes]
    held.kept_params = held.kept_grads = held.whole_grads = sum(numels) * compute  # cast model: that dtype
    if layout.strategy.startswith("zero"):
        owned = sorted_greedy_partition([numels], world_size)[rank][0]
        held.local_numels = [numels[i] for i in owned]
        staged, held.step_numels = _zero_buffers(layout, numels, held.local_numels, device)
        held.timeline.add(0, last, staged * compute)
        held.step_extra = staged * compute
    else:
        held.local_numels = numels
    held.timeline.add(0, last, held.whole_grads)  # DDP's buckets: a copy of every gradient
    if layout.optim_in_backward:
        _ddp_in_backward(held, trace, layout, compute, cost)
        return
    for unit in units if layout.grad_accum == 1 else ():  # else held all step by _accumulated
        for shape, released in zip(unit.shapes, unit.grad_released, strict=False):
            held.timeline.add(released, last, shape.numel() * compute, comm=False)


def _ddp_in_backward(held: _Held, trace: Trace, layout: Layout, compute: int, cost: OptimizerCost) -> None:
    """Each gradient held until its bucket's comm hook (from the step's start when accumulated), which points
    ``.grad`` at the bucket (freeing the gradient's own storage) just before stepping it; with exact clipping
    that view is kept and stepped at the end of backward."""
    units, last = trace.units, len(trace.live) - 1
    for index, (arrival, members) in enumerate(in_backward.ddp_buckets(units, compute)):
        op = min(arrival, last)
        sizes = [units[u].shapes[p].numel() for u, p in members]
        for (u, p), numel in zip(members, sizes, strict=True):
            released = units[u].grad_released[p]
            held.timeline.add(0 if layout.grad_accum > 1 else released, max(released, op) - 1, numel * compute,
                              comm=False)
        if layout.clip_mode != "exact":
            held.step_in_backward(op, _stepping(sizes, compute, cost), f"bucket {index}")
    if layout.clip_mode == "exact":  # the kept gradients are the bucket's views: only the temporaries are new
        largest = max((s.numel() for unit in units for s in unit.shapes), default=0)
        held.step_in_backward(last, cost.step_bytes([largest]), "every parameter, clipped")
    held.kept_grads = 0


def _stepping(sizes: list[int], element_size: int, cost: OptimizerCost) -> int:
    """The most bytes held while a bucket's parameters of ``sizes`` step one after another, each gradient freed
    just before its parameter steps: the gradients still waiting, and the stepping one's temporaries."""
    return max(sum(sizes[k + 1:]) * element_size + cost.step_bytes([numel]) for k, numel in enumerate(sizes))


def _zero_buffers(layout: Layout, numels: list[int], local: list[int], device: str) -> tuple[int, list[int]]:
    """Our ZeRO's extra elements held all step, and the sizes its optimizer's temporaries scale with.

    Without the bucket view, parameters of at most ``SMALL_NUMEL`` elements travel packed in one
    buffer (every rank's); with it, a copy of the rank's parameters that are stepped in merged chunks
    (measured on our ZeRO; the rank's whole bucket when nothing is chunked). On the CPU an elementwise optimizer steps
    pieces of at most ``CHUNK_NUMEL`` elements (see [Note: chunked step]), so its temporaries are that big.
    """
    from tensorplay.distributed.optim import zero

    CHUNK_NUMEL, SMALL_NUMEL = zero.CHUNK_NUMEL, zero.SMALL_NUMEL

    chunk = CHUNK_NUMEL if device == "cpu" and CHUNK_NUMEL is not None else None
    if layout.strategy == "zero":
        staged, pieces = sum(n for n in numels if n <= SMALL_NUMEL), local
    else:  # measured: the parameters stepped in merged chunks (those under a chunk) are held once more
        staged, pieces = sum(n for n in local if chunk is None or n < chunk), [sum(local)]
    if chunk is not None:
        pieces = [min(n, chunk) for n in pieces]
    return staged, pieces


def _accumulated(units: list[UnitTrace], layout: Layout, held: _Held, param_dtype: torch.dtype) -> int:
    """Gradients held from earlier micro-batches while the last one runs (gradient accumulation without sync):
    the whole gradients for DDP and ZeRO, every unit's unsharded gradients for the sharded strategies. With the
    optimizer in backward the timeline holds them (``_estimate_in_backward``)."""
    if layout.grad_accum == 1 or layout.optim_in_backward:
        return 0
    if layout.strategy in ("ddp", "zero", "zero_bucket_view"):
        return held.whole_grads
    if layout.strategy == "fsdp_no_shard":
        return held.kept_grads
    compute = _size(layout.param_dtype) if layout.param_dtype else _size(param_dtype)
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
