"""The measured side: one rank's live tensor bytes during a real training step of a strategy (on the CPU).

Run on every rank of an initialised process group (``run_distributed``): the
model is built for real, parallelized with our implementations (PyTorch's DDP
for ``ddp`` and under ``zero``), stepped once so the optimizer state and every
lazily made buffer exist, and then one more step (``zero_grad(set_to_none=True)``,
the micro-batches' forward and backward, the optimizer step) runs under
:class:`LiveBytes` started from every tensor alive (see [Note: counting live
tensor bytes]). With ``optim_in_backward`` the optimizer is our
``_apply_optimizer_in_backward`` (classic FSDP with ``use_orig_params=True``,
DDP through ``_register_optim_in_backward_hook``) and the step is the backward
itself (:class:`InBackwardSteps` stands for the optimizer). The predicted side
never runs this: it is how the estimate is checked (tests,
``bench/bench_estimate.py``).
"""

from __future__ import annotations

import gc
from collections.abc import Callable
from contextlib import nullcontext
from typing import Any

import torch
from torch import nn

from ._estimate_layouts import Layout
from ._estimate_live import LiveBytes
from ._estimate_trace import LossFn, checkpoint_units, default_units, unit_modules


def parallelize(model: nn.Module, layout: Layout, units: set[type[nn.Module]]) -> nn.Module:
    """``model`` sharded or replicated over the default group as ``layout`` says (with our implementations)."""
    import tensorplay.distributed as dist
    from tensorplay.distributed.device_mesh import init_device_mesh
    from tensorplay.distributed.fsdp import (
        FullyShardedDataParallel,
        MixedPrecision,
        MixedPrecisionPolicy,
        ShardingStrategy,
        fully_shard,
    )
    from tensorplay.distributed.fsdp.wrap import ModuleWrapPolicy

    world = dist.get_world_size()
    inner = [m for name, m in unit_modules(model, units) if name]
    if layout.activation_checkpointing:
        checkpoint_units(inner)
    if layout.strategy in ("fully_shard", "hsdp"):
        shape = (world // layout.shard_size(world), layout.shard_size(world))
        mesh = init_device_mesh("cpu", shape) if layout.strategy == "hsdp" else init_device_mesh("cpu", (world,))
        policy = MixedPrecisionPolicy(param_dtype=layout.param_dtype, reduce_dtype=layout.reduce_dtype)
        for module in inner:
            fully_shard(module, mesh=mesh, mp_policy=policy, reshard_after_forward=layout.reshard_after_forward)
        fully_shard(model, mesh=mesh, mp_policy=policy, reshard_after_forward=layout.reshard_after_forward)
        return model
    if layout.strategy.startswith("fsdp_"):
        mp = MixedPrecision(param_dtype=layout.param_dtype, reduce_dtype=layout.reduce_dtype,
                            keep_low_precision_grads=layout.keep_low_precision_grads) if layout.param_dtype else None
        return FullyShardedDataParallel(model, auto_wrap_policy=ModuleWrapPolicy(units), mixed_precision=mp,
                                        sharding_strategy=ShardingStrategy[layout.strategy[5:].upper()],
                                        use_orig_params=layout.optim_in_backward)
    from tensorplay.nn.parallel import DistributedDataParallel
    return DistributedDataParallel(model)


class InBackwardSteps:
    """Stands for the optimizer when it is applied in backward: the per-parameter optimizers' state; no step."""

    def __init__(self, model: nn.Module) -> None:
        from tensorplay.distributed.optim import _get_in_backward_optimizers
        self.optimizers = _get_in_backward_optimizers(model)

    @property
    def state(self) -> list[Any]:
        return [optimizer.state for optimizer in self.optimizers]

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Nothing to do: each gradient is freed once stepped (or at the end of backward)."""

    def step(self) -> None:
        """Nothing to do: backward stepped every parameter."""


def build_optimizer(model: nn.Module, layout: Layout, optimizer_class: type[torch.optim.Optimizer],
                    optimizer_kwargs: dict[str, Any]) -> Any:
    """The step's optimizer: ours for ZeRO, the optimizers applied in backward (:class:`InBackwardSteps`), or
    ``optimizer_class`` over the model's parameters."""
    if layout.optim_in_backward:
        return _apply_in_backward(model, layout, optimizer_class, optimizer_kwargs)
    if layout.strategy.startswith("zero"):
        from tensorplay.distributed.optim import ZeroRedundancyOptimizer
        return ZeroRedundancyOptimizer(model.parameters(), optimizer_class=optimizer_class,
                                       parameters_as_bucket_view=layout.strategy == "zero_bucket_view",
                                       **optimizer_kwargs)
    return optimizer_class(model.parameters(), **optimizer_kwargs)


def _apply_in_backward(model: nn.Module, layout: Layout, optimizer_class: type[torch.optim.Optimizer],
                       optimizer_kwargs: dict[str, Any]) -> InBackwardSteps:
    from tensorplay.distributed.optim.apply_optimizer_in_backward import (
        InBackwardOptions,
        _apply_optimizer_in_backward,
    )

    accumulation = layout.grad_accum if layout.strategy != "ddp" else 1  # DDP accumulates under no_sync()
    options = InBackwardOptions(accumulation_steps=accumulation, max_norm=1.0 if layout.clip_mode else None,
                                clip_mode=layout.clip_mode)
    _apply_optimizer_in_backward(optimizer_class, model.parameters(), optimizer_kwargs, options=options)
    if layout.strategy == "ddp":
        from tensorplay.distributed.algorithms.ddp_comm_hooks.optimizer_overlap_hooks import (
            _register_optim_in_backward_hook,
        )
        _register_optim_in_backward_hook(model)
    return InBackwardSteps(model)


def measure_step(build: Callable[[], nn.Module], make_batch: Callable[[], Any], layout: Layout,
                 optimizer_class: type[torch.optim.Optimizer], optimizer_kwargs: dict[str, Any],
                 loss_fn: LossFn, units: set[type[nn.Module]] | None = None) -> dict[str, Any]:
    """This rank's peak live CPU tensor bytes in a training step of ``layout`` (after a warm-up step), and where."""
    torch.manual_seed(0)
    model = build()
    units = default_units(model) if units is None else units
    model = parallelize(model, layout, units)
    optimizer = build_optimizer(model, layout, optimizer_class, optimizer_kwargs)
    batches = [make_batch() for _ in range(layout.grad_accum)]
    sync_every = layout.optim_in_backward and layout.strategy != "ddp"  # accumulated sharded, see Layout
    _step(model, optimizer, batches, loss_fn, None, sync_every)
    gc.collect()  # what an earlier run in this process left in reference cycles
    tracker = LiveBytes("cpu")
    tracker.add_all_alive()
    tracker.reset_peak()
    before = tracker.current
    tracker.timeline = []
    with tracker:
        _step(model, optimizer, batches, loss_fn, tracker, sync_every)
    phases: dict[str, int] = {}
    for live, where in tracker.timeline:
        phases[where] = max(phases.get(where, 0), live)
    return {"peak": tracker.peak, "where": tracker.peak_where, "before": before, "phase_peaks": phases,
            "model_states": model_state_bytes(model, optimizer)}


def model_state_bytes(model: nn.Module, optimizer: Any) -> int:
    """Bytes of this rank's parameters (local shards), gradients and optimizer state, each storage once."""
    inner = getattr(optimizer, "optim", optimizer)  # ZeRO's local optimizer
    params = list(model.parameters()) + _flat_params(model)
    tracker = LiveBytes(next(iter(params)).device if params else "cpu")
    tracker.add([params, [p.grad for p in params if p.grad is not None], inner.state])
    return tracker.current


def _flat_params(model: nn.Module) -> list[torch.Tensor]:
    """Classic FSDP's flat parameters, which ``use_orig_params=True`` hides from ``parameters()`` (their
    gradient shards are still held: see [Note: stepping in backward])."""
    handles = [getattr(getattr(m, "_fsdp_state", None), "handle", None) for m in model.modules()]
    return [h.flat_param for h in handles if h is not None]


def _step(model: nn.Module, optimizer: Any, batches: list[Any], loss_fn: LossFn, tracker: LiveBytes | None,
          sync_every: bool = False) -> None:
    """Micro-batches without gradient sync but the last (every one with ``sync_every``), then the step."""
    optimizer.zero_grad(set_to_none=True)
    for i, batch in enumerate(batches):
        last = i == len(batches) - 1 or sync_every
        wrapper: Any = model  # DDP and classic FSDP: no_sync(); fully_shard: set_requires_gradient_sync()
        sync = nullcontext() if last or not hasattr(wrapper, "no_sync") else wrapper.no_sync()
        if hasattr(wrapper, "set_requires_gradient_sync"):
            wrapper.set_requires_gradient_sync(last)
        with sync:
            if tracker is not None:
                tracker.where = "forward"
            loss = loss_fn(model(batch), batch)
            if tracker is not None:
                tracker.where = "backward"
            loss.backward()
    if tracker is not None:
        tracker.where = "optimizer step"
    optimizer.step()
