"""An optimizer applied in backward: when each reduced gradient is stepped, and how long it is held until then.

[Note: stepping in backward]
``_apply_optimizer_in_backward`` gives each parameter its own optimizer, which
a front end steps once the parameter's reduced gradient is handed out, and then
frees that gradient. When that happens in our implementations:

* fully_shard: a group's reduce-scatter is finished when the next group's
  gradients are ready (one reduce-scatter in flight), or at the end of
  backward for the last one; HSDP hands out after the all-reduce across
  replicas, at the end of backward;
* classic FSDP: every unit's reduction is finished at the end of backward;
* DDP: its comm hook steps a bucket once the bucket's last gradient is ready
  (buckets of 1 MiB first, then 25 MiB, filled in the order gradients arrive).

``clip_mode="exact"`` keeps every reduced gradient to the end of backward,
where the clipped step runs; ``"previous"`` steps at once (its first step runs
as ``"exact"``: the steady state is modelled). With accumulation the sharded
strategies reduce every micro-batch and add into the sharded gradient, held
from the step's start (the last micro-batch is modelled). Classic FSDP with
``use_orig_params=True`` keeps the unit's flat gradient shard when the views'
gradients were kept ("exact"): the clipped step frees the views', not the flat
one, which then lives until the unit's next pre-forward drops it (as PyTorch's).
"""

from __future__ import annotations

from tensorplay.distributed._sharding.layout import flat_layout

from ._estimate_layouts import Layout
from ._estimate_trace import UnitTrace

#: DDP's bucket caps (PyTorch's defaults): the first bucket, then every other one.
DDP_BUCKET_BYTES = (1 << 20, 25 << 20)


def handed_out(index: int, units: list[UnitTrace], layout: Layout, last: int) -> int:
    """The op at which unit ``index``'s reduced (sharded) gradient reaches its optimizer."""
    if layout.strategy != "fully_shard":  # classic FSDP, HSDP: at the end of backward
        return last
    unit = units[index]
    later = [u.bwd_end for u in units if u is not unit and u.shapes and u.bwd_end > unit.bwd_end]
    # In that group's post-backward hook, once its own unsharded gradients went to their reduce-scatter.
    return min(min(later) + 1, last) if later else last


def steps_at(index: int, units: list[UnitTrace], layout: Layout, last: int) -> int:
    """The op at which unit ``index``'s parameters step: at hand-out, or at the end of backward ("exact")."""
    return last if layout.clip_mode == "exact" else handed_out(index, units, layout, last)


def sharded_grad_spans(index: int, units: list[UnitTrace], layout: Layout, last: int) -> list[tuple[int, int]]:
    """The spans of ops during which unit ``index``'s sharded gradient (one shard's bytes each) is held."""
    unit = units[index]
    if not layout.optim_in_backward:
        return [(unit.bwd_end, last)]
    out = handed_out(index, units, layout, last)
    step = steps_at(index, units, layout, last)
    if layout.grad_accum > 1:  # the earlier micro-batches' sum, and this one's reduction until it is added
        return [(0, step), (unit.bwd_end, out)]
    if keeps_flat_grad(layout):  # the previous step's flat shard until the unit's pre-forward drops it
        return [(0, max(unit.fwd_start, 0)), (unit.bwd_end, step)]
    return [(unit.bwd_end, step)]


def keeps_flat_grad(layout: Layout) -> bool:
    """Classic FSDP's flat gradient shard outlives a kept ("exact") step (see [Note: stepping in backward])."""
    return layout.optim_in_backward and layout.clip_mode == "exact" and layout.strategy.startswith("fsdp_") \
        and layout.grad_accum == 1


def orig_param_pieces(shapes: list, shards: int, rank: int) -> list[int]:
    """Elements of each original parameter inside ``rank``'s flat shard (classic FSDP, ``use_orig_params``);
    parameters with none there get no gradient and no optimizer state."""
    layout = flat_layout(shapes, shards)
    start, end = layout.shard_range(rank % shards)
    pieces = [min(end, off + n) - max(start, off) for off, n in zip(layout.offsets, layout.numels, strict=True)]
    return [p for p in pieces if p > 0]


def ddp_buckets(units: list[UnitTrace], element_size: int) -> list[tuple[int, list[tuple[int, int]]]]:
    """DDP's buckets as its reducer rebuilds them after the first step: (the op at which the bucket's last
    gradient arrives and its comm hook steps it, its parameters as (unit, parameter) in arrival order)."""
    arrivals = sorted((arrival, u, p) for u, unit in enumerate(units) for p, arrival in enumerate(unit.grad_arrivals))
    buckets: list[tuple[int, list[tuple[int, int]]]] = []
    members: list[tuple[int, int]] = []
    filled, caps = 0, list(DDP_BUCKET_BYTES)
    for position, (arrival, u, p) in enumerate(arrivals):
        members.append((u, p))
        filled += units[u].shapes[p].numel() * element_size
        if filled >= caps[0] or position == len(arrivals) - 1:
            buckets.append((arrival, members))
            members, filled, caps = [], 0, caps[1:] or caps
    return buckets
