"""Will it fit? One rank's memory for a training step under every strategy, without allocating it.

    from tensorplay.distributed import estimate_memory
    with torch.device("meta"):
        model = ByteLM(LMConfig())
    estimate = estimate_memory(model, BatchSpec((8, 256), torch.long), world_size=8, strategy="fully_shard")
    print(estimate.table())                     # every strategy side by side, this one first
    plan(model, BatchSpec((8, 256), torch.long), world_size=8, budget_bytes=80 * 2**30)

How: one micro-batch's forward and backward on the meta device gives the
activations' timeline (``_estimate_trace``); each strategy's parameters,
gradients, buffers and optimizer state are added per op from our sharding
layout (``_estimate_strategies``; an optimizer applied in backward steps inside
it: ``_estimate_in_backward``); what the optimizer keeps is probed on a small
real tensor (``_estimate_optim``). No process group and no real memory.
Checked against a tracker of live tensor bytes during real steps of our
implementations (``_estimate_measure``, ``bench/bench_estimate.py``).
Command line: ``python -m tensorplay.distributed.estimate --help``.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_map

from ._estimate_layouts import CLASSIC, COMM_VOLUME, IN_BACKWARD, STRATEGIES, Layout
from ._estimate_live import LiveBytes
from ._estimate_optim import probe_optimizer
from ._estimate_strategies import RankMemory, predict
from ._estimate_trace import LossFn, Trace, default_loss, default_units, params_by_unit, trace_step, unit_modules

__all__ = ["STRATEGIES", "BatchSpec", "Layout", "LiveBytes", "MemoryEstimate", "PlanEntry", "RankMemory",
           "estimate_memory", "plan"]

#: A model not on the meta device is copied there when its parameters take at most this many bytes.
MAX_REAL_MODEL_BYTES = 1 << 30


@dataclass(frozen=True)
class BatchSpec:
    """A batch by shape and dtype only (dim 0 is the rows of one rank's step)."""

    shape: tuple[int, ...]
    dtype: torch.dtype = torch.float32

    def meta(self) -> torch.Tensor:
        return torch.empty(self.shape, dtype=self.dtype, device="meta")


@dataclass
class MemoryEstimate:
    """Per rank memory of ``layout`` over ``world_size`` ranks, and the other strategies' side by side."""

    layout: Layout
    world_size: int
    ranks: list[RankMemory]
    others: dict[str, list[RankMemory]] = field(default_factory=dict)

    @property
    def peak(self) -> int:
        """The largest rank's peak."""
        return max(r.peak for r in self.ranks)

    def table(self) -> str:
        """A markdown table: this layout, then every other strategy, by the rank with the largest peak."""
        rows = [(self.layout.label, self.ranks)] + list(self.others.items())
        head = ("| strategy | params | grads | optimizer | activations | comm buffers | offloaded | peak | where |\n"
                "|---|---:|---:|---:|---:|---:|---:|---:|---|\n")
        lines = []
        for label, ranks in rows:
            r = max(ranks, key=lambda m: m.peak)
            lines.append(f"| {label} | {_fmt(r.params)} | {_fmt(r.grads)} | {_fmt(r.optimizer_state)} | "
                         f"{_fmt(r.activations)} | {_fmt(r.comm_buffers)} | {_fmt(r.offloaded)} | "
                         f"**{_fmt(r.peak)}** | {r.where} |")
        return head + "\n".join(lines)

    def rank_table(self) -> str:
        """This layout per rank, in MiB: parameters, gradients, optimizer state, predicted peak and where."""
        mib = 1 << 20
        lines = [f"{'rank':>4} {'params MiB':>11} {'grads MiB':>10} {'optim MiB':>10} {'peak MiB':>9}  where"]
        for rank, r in enumerate(self.ranks):
            lines.append(f"{rank:>4} {r.params / mib:>11.2f} {r.grads / mib:>10.2f} {r.optimizer_state / mib:>10.2f} "
                         f"{r.peak / mib:>9.2f}  {r.where}")
        return "\n".join(lines)


@dataclass(frozen=True)
class PlanEntry:
    """A strategy that fits: its peak at the given batch, the bytes it moves per step, the largest batch."""

    layout: Layout
    peak: int
    comm_bytes: int
    max_batch: int


def estimate_memory(model: nn.Module | Callable[[], nn.Module], batch: Any, *, world_size: int,
                    strategy: str | Layout = "fully_shard",
                    optimizer_class: type[torch.optim.Optimizer] = torch.optim.AdamW,
                    optimizer_kwargs: dict[str, Any] | None = None, loss_fn: LossFn | None = None,
                    units: set[type[nn.Module]] | None = None, compare: bool = True, device: str = "cuda",
                    **layout_options: Any) -> MemoryEstimate:
    """Predict each rank's memory for one training step of ``model`` on ``batch`` (one rank's rows per step).

    ``model``: built on the meta device, a function that builds it (called under ``torch.device("meta")``),
    or a small real model (copied to meta). ``batch``: tensors (real or meta), a :class:`BatchSpec`, or a
    tuple of either (positional inputs). ``strategy``: a name of :data:`STRATEGIES` or a :class:`Layout`;
    ``layout_options`` are :class:`Layout` fields (``reshard_after_forward``, ``param_dtype``,
    ``reduce_dtype``, ``cpu_offload``, ``activation_checkpointing``, ``grad_accum``, ``hsdp_shard_size``,
    ``keep_low_precision_grads``, ``optim_in_backward`` with its ``clip_mode``): an optimizer applied in
    backward has no optimizer-step peak; its steps are inside backward, named in ``where``.
    ``units``: the module classes sharded as their own unit (default: what the model's ``nn.ModuleList`` s
    hold), the root being one more. ``compare``: also estimate every other strategy with the same options.
    ``device``: the type of device the step will run on (``"cuda"``, ``"cpu"``...): on the CPU our
    collectives go through shared memory, which changes the communication buffers.
    """
    layout = _layout(strategy, layout_options)
    _check_world_size(world_size)
    meta_model = _meta_model(model)
    units = default_units(meta_model) if units is None else units
    cost = probe_optimizer(optimizer_class, optimizer_kwargs or {}, torch.device(device).type)
    traces: dict[tuple[Any, ...], Trace] = {}

    def ranks_of(lay: Layout) -> list[RankMemory]:
        key = (lay.param_dtype, lay.activation_checkpointing, lay.grad_accum)
        if key not in traces:
            traces[key] = trace_step(meta_model, _micro_batch(batch, lay.grad_accum), units=units,
                                     loss_fn=loss_fn or default_loss, param_dtype=lay.param_dtype,
                                     activation_checkpointing=lay.activation_checkpointing)
        return [predict(traces[key], lay, world_size, rank, cost, torch.device(device).type)
                for rank in range(world_size)]

    estimate = MemoryEstimate(layout, world_size, ranks_of(layout))
    if compare:
        for other in _comparable(layout):
            estimate.others[other.label] = ranks_of(other)
    return estimate


def plan(model: nn.Module | Callable[[], nn.Module], batch: Any, world_size: int, budget_bytes: int,
         **estimate_options: Any) -> list[PlanEntry]:
    """The strategies whose every rank fits ``budget_bytes``, least communication first, with the largest batch.

    The largest batch (rows of dim 0 per rank) comes from the peak at ``batch`` and at twice its rows,
    taken as linear in the rows. Raises ``ValueError`` when ``budget_bytes`` is below one unit's
    parameters (nothing can fit: every strategy gathers at least one unit whole).
    """
    meta_model = _meta_model(model)
    _check_budget(meta_model, budget_bytes, estimate_options.get("units"))
    at_once = estimate_memory(meta_model, batch, world_size=world_size, **estimate_options)
    doubled = estimate_memory(meta_model, _scaled_rows(batch, 2), world_size=world_size, **estimate_options)
    rows = _rows(batch)
    numel = sum(p.numel() for p in meta_model.parameters())
    entries = []
    for (label, ranks), (_, ranks2) in zip(_all_rows(at_once), _all_rows(doubled), strict=True):
        peak, peak2 = max(r.peak for r in ranks), max(r.peak for r in ranks2)
        if peak > budget_bytes:
            continue
        per_row = max((peak2 - peak) / rows, 1.0)
        largest = rows + int((budget_bytes - peak) // per_row)
        entries.append(PlanEntry(label, peak, _comm_bytes(label, numel, world_size), largest))
    return sorted(entries, key=lambda e: (e.comm_bytes, e.peak))


# ---- helpers ---------------------------------------------------------------------------------------------

def _comm_bytes(layout: Layout, numel: int, world_size: int) -> int:
    """Bytes a rank sends per step (ring collectives): :data:`COMM_VOLUME` model sizes, in the compute dtype
    (gradients in ``reduce_dtype``); fully_shard without resharding gathers once, not twice."""
    compute = torch.empty((), dtype=layout.param_dtype or torch.float32, device="meta").element_size()
    volume = COMM_VOLUME[layout.strategy]
    if layout.strategy in ("fully_shard", "hsdp") and not layout.reshards:
        volume -= 1
    return int(volume * numel * compute * (world_size - 1) / world_size)


def _fmt(nbytes: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= scale:
            return f"{nbytes / scale:.2f} {unit}"
    return f"{nbytes} B"


def _layout(strategy: str | Layout, options: dict[str, Any]) -> Layout:
    if isinstance(strategy, Layout):
        return replace(strategy, **options)
    if not isinstance(strategy, str) or strategy not in STRATEGIES:
        raise ValueError(f"strategy {strategy!r} is not one the estimator knows; choose one of {', '.join(STRATEGIES)}")
    try:
        return Layout(strategy, **options)
    except TypeError as error:
        raise TypeError(f"estimate_memory: unknown layout option ({error}); the options are the fields of Layout") \
            from None


def _check_world_size(world_size: int) -> None:
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive int, got {world_size!r}")


def _meta_model(model: nn.Module | Callable[[], nn.Module]) -> nn.Module:
    if not isinstance(model, nn.Module):
        if not callable(model):
            raise TypeError(f"model must be an nn.Module or a function that builds one, got {type(model).__name__}")
        with torch.device("meta"):
            model = model()
        if not isinstance(model, nn.Module):
            raise TypeError(f"model: the function returned {type(model).__name__}, not an nn.Module")
    tensors = [*model.parameters(), *model.buffers()]
    real = [t for t in tensors if t.device.type != "meta"]
    if not real:
        return model
    nbytes = sum(t.nbytes for t in real)
    if nbytes > MAX_REAL_MODEL_BYTES:
        raise ValueError(f"model: its parameters and buffers hold {nbytes / 2**30:.2f} GiB on {real[0].device}, "
                         f"over the {MAX_REAL_MODEL_BYTES / 2**30:.0f} GiB the estimator copies; build it on the meta "
                         f"device (with torch.device('meta'): ...) or pass a function that builds it")
    return copy.deepcopy(model).to("meta")


def _comparable(layout: Layout) -> list[Layout]:
    """Every other strategy with the options that apply to it (offload only where it exists)."""
    others = []
    for name in STRATEGIES:
        offload = layout.cpu_offload and name in ("fully_shard", "hsdp") or \
            (layout.cpu_offload and name.startswith("fsdp_") and name != "fsdp_no_shard")
        in_backward = layout.optim_in_backward and name in IN_BACKWARD
        other = replace(layout, strategy=name, cpu_offload=offload, reshard_after_forward=None,
                        keep_low_precision_grads=layout.keep_low_precision_grads and name in CLASSIC,
                        optim_in_backward=in_backward, clip_mode=layout.clip_mode if in_backward else None)
        if other != layout:
            others.append(other)
    if layout.strategy != "fully_shard" or layout.reshards:
        no_reshard = replace(layout, strategy="fully_shard", reshard_after_forward=False)
        others.insert(1, no_reshard)
    return [o for o in others if o != layout]


def _all_rows(estimate: MemoryEstimate) -> list[tuple[Layout, list[RankMemory]]]:
    layouts = [estimate.layout] + _comparable(estimate.layout)
    return list(zip(layouts, [estimate.ranks] + list(estimate.others.values()), strict=True))


def _tensors(batch: Any) -> Any:
    return tree_map(lambda t: t.meta() if isinstance(t, BatchSpec) else t, batch,
                    is_leaf=lambda t: isinstance(t, BatchSpec))


def _rows(batch: Any) -> int:
    leaves = [t for t in torch.utils._pytree.tree_leaves(_tensors(batch)) if isinstance(t, torch.Tensor)]
    if not leaves or leaves[0].dim() == 0:
        raise ValueError("batch: needs at least one tensor with a batch dimension (dim 0)")
    return leaves[0].shape[0]


def _micro_batch(batch: Any, grad_accum: int) -> Any:
    rows = _rows(batch)
    if rows % grad_accum:
        raise ValueError(f"grad_accum {grad_accum} must divide the batch's {rows} rows")
    return tree_map(lambda t: t[: rows // grad_accum].to("meta") if isinstance(t, torch.Tensor) else t,
                    _tensors(batch))


def _scaled_rows(batch: Any, factor: int) -> Any:
    return tree_map(lambda t: torch.empty((t.shape[0] * factor, *t.shape[1:]), dtype=t.dtype, device="meta")
                    if isinstance(t, torch.Tensor) else t, _tensors(batch))


def _check_budget(model: nn.Module, budget_bytes: int, units: set[type[nn.Module]] | None) -> None:
    found = unit_modules(model, default_units(model) if units is None else units)
    grouped = params_by_unit(model, found)
    sizes = [(sum(p.nbytes for p in ps), name or "(root)") for (name, _), ps in zip(found, grouped, strict=True)]
    largest, name = max(sizes, key=lambda size_name: size_name[0])  # the first of the largest
    if budget_bytes < largest:
        raise ValueError(f"budget_bytes {budget_bytes} is smaller than one layer: unit {name} alone holds {largest} "
                         f"bytes of parameters, gathered whole by every strategy")

