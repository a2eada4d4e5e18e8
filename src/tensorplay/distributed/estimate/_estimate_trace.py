"""One rank's micro-batch through the unsharded model on the meta device: the step's timeline of live bytes.

The model runs forward and backward on meta tensors (nothing allocated) under
:class:`LiveBytes`. Parameters are not counted and each gradient is dropped the
moment it is accumulated, so the timeline holds activations and temporaries
only; what each strategy keeps of parameters and gradients is added per op by
``_estimate_strategies`` from the moments recorded here: when each unit's
forward starts and ends, when its backward starts (the gradient of its output
arrives) and when each of its parameters' gradients arrives.
"""

from __future__ import annotations

import copy
import weakref
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_leaves, tree_map
from torch.utils.checkpoint import checkpoint

from ._estimate_live import LiveBytes

LossFn = Callable[[Any, Any], torch.Tensor]


@dataclass
class UnitTrace:
    """One sharding unit (a module given its own ``fully_shard`` / FSDP wrapper; index 0 is the root)."""

    name: str
    shapes: list[torch.Size]
    fwd_start: int = -1
    fwd_end: int = -1
    bwd_start: int = -1
    bwd_end: int = -1
    grad_arrivals: list[int] = field(default_factory=list)  # per parameter (in ``shapes`` order), the op index
    #: per parameter, the op index from which the timeline no longer counts its gradient (the autograd
    #: engine may hold the tensor a few ops after accumulating it); the strategy counts it from there
    grad_released: list[int] = field(default_factory=list)

    @property
    def numel(self) -> int:
        return sum(s.numel() for s in self.shapes)


@dataclass
class Trace:
    """Live activation bytes after each op of forward and backward, labelled, and the units' moments."""

    live: list[int]
    where: list[str]
    units: list[UnitTrace]
    backward_start: int
    param_dtype: torch.dtype  # the model's own (the sharded strategies' storage), before any mixed-precision cast


def default_loss(output: Any, batch: Any) -> torch.Tensor:
    """The mean of the output's floating-point values (the loss when none is given)."""
    leaves = [t for t in tree_leaves(output) if isinstance(t, torch.Tensor) and t.is_floating_point()]
    return sum(t.float().mean() for t in leaves)  # type: ignore[return-value]


def default_units(model: nn.Module) -> set[type[nn.Module]]:
    """The classes of the modules held in the model's ``nn.ModuleList`` s (transformer blocks, MLP layers)."""
    return {type(child) for module in model.modules() if isinstance(module, nn.ModuleList) for child in module}


def unit_modules(model: nn.Module, units: set[type[nn.Module]]) -> list[tuple[str, nn.Module]]:
    """``(name, module)`` of the root and of every module of a class in ``units``, in definition order."""
    return [("", model)] + [(name, m) for name, m in model.named_modules() if name and type(m) in units]


def params_by_unit(model: nn.Module, units: list[tuple[str, nn.Module]]) -> list[list[nn.Parameter]]:
    """Each unit's own parameters (those under no inner unit); a tied parameter goes to its first unit."""
    owner: dict[int, int] = {}
    for index in range(len(units)):  # an inner unit comes after its outer one: it wins
        for p in units[index][1].parameters():
            owner[id(p)] = index
    grouped: list[list[nn.Parameter]] = [[] for _ in units]
    seen: set[int] = set()
    for p in model.parameters():
        if id(p) not in seen:
            seen.add(id(p))
            grouped[owner[id(p)]].append(p)
    return grouped


def checkpoint_units(units: Sequence[nn.Module], context: Callable[[], Any] = nullcontext) -> None:
    """Activation checkpointing: each module of ``units`` recomputes its forward in backward.

    ``context()`` is entered around the forward and its recomputation (the recomputation runs
    inside autograd, where modes entered around ``backward()`` are not active).
    """
    for module in units:
        def run(*args: Any, _forward: Callable[..., Any] = module.forward, **kwargs: Any) -> Any:
            with context():
                return _forward(*args, **kwargs)

        module.forward = (lambda *a, _run=run, **k: checkpoint(_run, *a, use_reentrant=False, **k))  # type: ignore


def trace_step(model: nn.Module, batch: Any, *, units: set[type[nn.Module]], loss_fn: LossFn,
               param_dtype: torch.dtype | None, activation_checkpointing: bool) -> Trace:
    """Forward and backward of ``batch`` through a meta copy of ``model``, in ``param_dtype`` when given."""
    meta = copy.deepcopy(model) if _on_meta(model) else model
    storage_dtype = next((p.dtype for p in meta.parameters()), torch.float32)
    if param_dtype is not None:
        meta = meta.to(param_dtype)
    batch = tree_map(lambda t: _meta_input(t, param_dtype) if isinstance(t, torch.Tensor) else t, batch)
    found = unit_modules(meta, units)
    grouped = params_by_unit(meta, found)
    traces = [UnitTrace(name or "(root)", [p.shape for p in ps]) for (name, _), ps in zip(found, grouped, strict=True)]
    if activation_checkpointing:
        checkpoint_units([m for name, m in found if name], FusedAttention)
    tracker = LiveBytes("meta")
    tracker.timeline = []
    handles = _hook_units(meta, found, traces, grouped, tracker)
    try:
        with tracker, FusedAttention():
            tracker.where = "forward"
            loss = loss_fn(meta(*batch) if isinstance(batch, tuple) else meta(batch), batch)
            backward_start = len(tracker.timeline)
            tracker.where = "backward"
            loss.backward()
    finally:
        for handle in handles:
            handle.remove()
    live = [b for b, _ in tracker.timeline]
    where = [w for _, w in tracker.timeline]
    for unit in traces:  # a parameter without a gradient (unused) arrives at the end of backward
        unit.grad_arrivals = [a if a >= 0 else len(live) - 1 for a in unit.grad_arrivals]
        unit.grad_released = [max(r, a) for r, a in zip(unit.grad_released, unit.grad_arrivals, strict=True)]
        if unit.grad_arrivals:
            unit.bwd_end = max(unit.grad_arrivals)
            unit.bwd_start = min(unit.bwd_start if unit.bwd_start >= 0 else len(live), min(unit.grad_arrivals))
    return Trace(live, where, traces, backward_start, storage_dtype)


class FusedAttention(TorchFunctionMode):
    """``scaled_dot_product_attention`` as a fused kernel that keeps only its output and log-sum-exp.

    On the meta device PyTorch picks the math path, which materializes the
    (batch, heads, seq, seq) attention weights; CPUs and GPUs run a fused
    (flash) kernel. Its CPU flavour has meta kernels and the same saved tensors.
    """

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func is torch.nn.functional.scaled_dot_product_attention and kwargs.get("attn_mask") is None \
                and len(args) == 3 and not kwargs.get("enable_gqa"):
            flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
            return flash(*args, kwargs.get("dropout_p", 0.0), kwargs.get("is_causal", False),
                         scale=kwargs.get("scale"))[0]
        return func(*args, **kwargs)


def _meta_input(tensor: torch.Tensor, param_dtype: torch.dtype | None) -> torch.Tensor:
    """``tensor`` on meta; a floating one in ``param_dtype``, as both FSDPs' mixed precision casts the root's
    inputs (the meta kernels would otherwise compute, and keep, the activations in the input's dtype)."""
    if param_dtype is not None and tensor.is_floating_point():
        return tensor.to("meta", param_dtype)
    return tensor.to("meta")


def _on_meta(model: nn.Module) -> bool:
    return all(t.device.type == "meta" for t in [*model.parameters(), *model.buffers()])


def _hook_units(model: nn.Module, found: list[tuple[str, nn.Module]], traces: list[UnitTrace],
                grouped: list[list[nn.Parameter]], tracker: LiveBytes) -> list[Any]:
    """Hooks that label the timeline and record each unit's moments (removed by the caller)."""
    assert tracker.timeline is not None
    timeline = tracker.timeline
    handles: list[Any] = []
    names = {id(m): name for name, m in model.named_modules()}

    def label(module: nn.Module, *_: Any) -> None:
        if torch.is_grad_enabled():
            tracker.where = f"forward {names.get(id(module)) or '(root)'}"

    handles += [module.register_forward_pre_hook(label) for module in model.modules()]  # no global hook
    for unit, (_, module), params in zip(traces, found, grouped, strict=True):
        def pre(_m: nn.Module, _a: Any, unit: UnitTrace = unit) -> None:
            if unit.fwd_start < 0:
                unit.fwd_start = len(timeline)

        def post(_m: nn.Module, _a: Any, out: Any, unit: UnitTrace = unit) -> None:
            if unit.fwd_end < 0:
                unit.fwd_end = len(timeline)
            for t in tree_leaves(out):
                if isinstance(t, torch.Tensor) and t.requires_grad:
                    t.register_hook(lambda g, unit=unit: _mark_backward(unit, len(timeline), tracker))

        handles += [module.register_forward_pre_hook(pre), module.register_forward_hook(post)]
        unit.grad_arrivals = [-1] * len(params)
        unit.grad_released = [-1] * len(params)
        for index, param in enumerate(params):
            def arrived(p: torch.Tensor, unit: UnitTrace = unit, index: int = index) -> None:
                if unit.grad_arrivals[index] < 0:
                    unit.grad_arrivals[index] = len(timeline)
                tracker.where = f"backward {unit.name}"
                if p.grad is not None:  # the strategy holds it from when the timeline stops counting it
                    unit.grad_released[index] = -1
                    weakref.finalize(p.grad.untyped_storage(), _released, unit, index, timeline)
                p.grad = None
            handles.append(param.register_post_accumulate_grad_hook(arrived))
    return handles


def _released(unit: UnitTrace, index: int, timeline: list[Any]) -> None:
    unit.grad_released[index] = len(timeline)


def _mark_backward(unit: UnitTrace, index: int, tracker: LiveBytes) -> None:
    if unit.bwd_start < 0:
        unit.bwd_start = index
    tracker.where = f"backward {unit.name}"
