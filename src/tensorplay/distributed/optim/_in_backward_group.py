"""When the optimizers of one ``apply_optimizer_in_backward`` call step: accumulation and clipping.

Each front end reports a parameter whose gradient is final for this backward
(:meth:`InBackwardGroup.grad_ready`): a plain module from a post-accumulate-grad
hook, fully_shard once the parameter's reduce-scatter has landed (its
``.grad`` then is the sharded gradient). The group decides:

* not the ``accumulation_steps``-th delivery yet: keep ``.grad`` (the next one
  accumulates into it);
* no clipping: step now and free ``.grad``;
* ``"exact"`` clipping (and the first ``"previous"`` step): keep ``.grad``;
  at the end of backward, one all-reduce of the norm, then clip, step and free
  every kept gradient;
* ``"previous"`` clipping: fold ``.grad`` into this step's norm, step with the
  previous step's coefficient, free; at the end of backward the norm is
  all-reduced once for the next step.

See [Note: the two clipping modes and their memory price] in
``_in_backward_options.py``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor
from torch.autograd import Variable
from torch.distributed.tensor import DTensor

import tensorplay.distributed as dist
from tensorplay.distributed.optim._in_backward_clip import NormPart, clip_coefficient, local_norm_part
from tensorplay.distributed.optim._in_backward_options import InBackwardOptions

__all__ = ["InBackwardGroup"]


class InBackwardGroup:
    """The in-backward optimizers of one call, their options, and the state between backwards."""

    options: InBackwardOptions
    last_norm: Tensor | None  # the global norm of the last step's gradients (clipping only)
    last_coefficient: Tensor | None  # the factor the last step's gradients were multiplied by

    def __init__(self, options: InBackwardOptions) -> None:
        self.options = options
        self.last_norm, self.last_coefficient = None, None
        self._optimizers: dict[Tensor, list[Any]] = {}  # class optimizers, or functional ones (step_param)
        self._deliveries: dict[Tensor, int] = {}
        self._kept: list[Tensor] = []  # gradients waiting for this step's norm
        self._shard_groups: dict[Tensor, tuple[object, ...]] = {}  # what a plain sharded gradient is split over
        self._norm: NormPart | None = None  # "previous": this step's norm, summed as gradients pass
        self._end_queued = False
        self._ranks_agree = False
        self._stepping = False
        self.skipped_steps = 0  # steps a grad_scaler skipped on inf/nan

    def add(self, param: Tensor, optimizer: Any) -> None:
        self._optimizers.setdefault(param, []).append(optimizer)
        self._deliveries.setdefault(param, 0)
        if not self.options.is_default and isinstance(optimizer, torch.optim.Optimizer):
            optimizer.register_step_pre_hook(self._refuse_direct_step)

    # ---- events ---------------------------------------------------------------------------------
    def grad_ready(self, param: Tensor, shard_groups: tuple[object, ...] = ()) -> bool:
        """``param.grad`` is final for this backward; True when the gradient must be kept (not freed).

        ``shard_groups``: the groups a plain-tensor gradient is a shard over (classic FSDP), for the norm.
        """
        self._queue_end_of_backward()
        self._shard_groups[param] = shard_groups
        count = self._deliveries[param] + 1
        if count < self.options.accumulation_steps:
            self._deliveries[param] = count
            return True
        self._deliveries[param] = 0
        if param.grad is None:
            return False
        if self.options.keeps_gradients or (self.options.clip_mode == "previous" and self.last_norm is None):
            self._kept.append(param)
            return True
        if self.options.clip_mode is None:
            self._step(param)
            return False
        self._fold_into_norm(param.grad, shard_groups)
        assert self.last_coefficient is not None  # set with last_norm
        _scale(param.grad, self.last_coefficient)
        self._step(param)
        return False

    def end_of_backward(self) -> None:
        """Every gradient of this backward has been delivered: check ranks once, step what waits for the norm."""
        self._end_queued = False
        if not self._ranks_agree:
            self._check_accumulation_across_ranks()
            self._ranks_agree = True
        if self._kept:
            self._step_kept()
        elif self._norm is not None:  # "previous": this step's norm clips the next one
            self._set_norm(self._norm.total())
            self._norm = None

    # ---- steps ----------------------------------------------------------------------------------
    def _step(self, param: Tensor, free: bool = False) -> None:
        """Step ``param``'s optimizers of this call; ``free`` drops ``.grad`` (else the caller does, once every
        call holding the parameter has stepped)."""
        self._stepping = True
        try:
            for optimizer in self._optimizers[param]:
                if isinstance(optimizer, torch.optim.Optimizer):
                    optimizer.step()
                else:
                    optimizer.step_param(param, param.grad)
        finally:
            self._stepping = False
        if free:
            param.grad = None

    def _step_kept(self) -> None:
        waiting, self._kept = {id(p) for p in self._kept}, []
        kept = [p for p in self._optimizers if id(p) in waiting]  # parameter order, as clip_grad_norm_ sums
        scaler = self.options.grad_scaler
        if scaler is None:
            self._clip_and_step(kept)
            return
        proxy = _KeptGradients(kept, self._clip_and_step)
        scaler.unscale_(proxy)  # unscales, finds inf/nan on every rank
        scaler.step(proxy)  # steps only without inf/nan
        self.skipped_steps += int(not proxy.stepped)
        for param in kept:
            param.grad = None

    def _clip_and_step(self, kept: list[Tensor]) -> None:
        if self.options.max_norm is not None:
            grads = [(p.grad, self._shard_groups[p]) for p in kept if p.grad is not None]
            self._set_norm(local_norm_part(grads, self.options.norm_type).total())
            assert self.last_coefficient is not None
            for param in kept:
                if param.grad is not None:
                    _scale(param.grad, self.last_coefficient)
        for param in kept:
            self._step(param, free=True)

    def _set_norm(self, norm: Tensor | None) -> None:
        if norm is None:
            return
        assert self.options.max_norm is not None
        self.last_norm, self.last_coefficient = norm, clip_coefficient(norm, self.options.max_norm)

    def _fold_into_norm(self, grad: Tensor, shard_groups: tuple[object, ...]) -> None:
        if self._norm is None:
            self._norm = NormPart(self.options.norm_type)
        self._norm.add(grad, shard_groups)

    def _queue_end_of_backward(self) -> None:
        if self._end_queued:
            return
        if torch._C._current_graph_task_id() == -1:  # handed out after backward (a deferred reduction)
            if self.options.keeps_gradients or self.options.clip_mode is not None:
                raise RuntimeError("apply_optimizer_in_backward: a gradient was handed out after backward ended "
                                   "(fully_shard's set_is_last_backward(False)?); clipping and grad_scaler need "
                                   "every gradient within the backward: keep is_last_backward True")
            return  # stepped at once; nothing waits for the end of backward
        self._end_queued = True
        Variable._execution_engine.queue_callback(self.end_of_backward)

    def _refuse_direct_step(self, optimizer: torch.optim.Optimizer, args: object, kwargs: object) -> None:
        if not self._stepping:
            raise RuntimeError(f"apply_optimizer_in_backward: this {type(optimizer).__name__} has "
                               f"InBackwardOptions ({self.options}); it is stepped by backward (accumulation and "
                               "clipping are applied there), not by calling step() directly. A front end that "
                               "steps in-backward optimizers itself (the DDP comm hook) supports only the default "
                               "options; use fully_shard or a plain module for these options")

    # ---- checks ---------------------------------------------------------------------------------
    def _check_accumulation_across_ranks(self) -> None:
        """One all-reduce (max of K and -K) on the first backward; the names of the ranks only on a mismatch."""
        group = self._rank_group()
        if group is None:
            return
        steps = self.options.accumulation_steps
        both = torch.tensor([steps, -steps], dtype=torch.int64, device=self._device())
        dist.all_reduce(both, op=dist.ReduceOp.MAX, group=group)
        if int(both[0]) == steps and -int(both[1]) == steps:
            return
        everyone = [torch.zeros(1, dtype=torch.int64, device=both.device) for _ in range(dist.get_world_size(group))]
        dist.all_gather(everyone, both[:1].clone().fill_(steps), group=group)
        per_rank = {dist.get_global_rank(group, i): int(t) for i, t in enumerate(everyone)}
        differing = sorted(r for r, k in per_rank.items() if k != steps)
        raise ValueError(f"apply_optimizer_in_backward: InBackwardOptions.accumulation_steps differs across ranks: "
                         f"rank {dist.get_rank()} has {steps}, rank(s) {differing} have "
                         f"{[per_rank[r] for r in differing]} (all ranks: {per_rank}); every rank must accumulate "
                         "the same number of micro-batches")

    def _rank_group(self) -> Any:
        """The group the ranks training these parameters share: a DTensor's mesh, else the default group."""
        param = next(iter(self._optimizers), None)
        if isinstance(param, DTensor):
            mesh = param.device_mesh
            return mesh.get_group() if mesh.ndim == 1 else dist.group.WORLD
        if self.options.accumulation_steps == 1 or not dist.is_initialized():
            return None
        return dist.group.WORLD

    def _device(self) -> torch.device:
        param = next(iter(self._optimizers))
        return param.device


class _KeptGradients(torch.optim.Optimizer):
    """The kept parameters as one optimizer, for a GradScaler: ``unscale_`` reads their gradients, ``step``
    (called by the scaler only without inf/nan) clips and steps them through their group."""

    _steps_in_backward = True  # not a plain optimizer over in-backward parameters (see _check_plain_step)

    def __init__(self, params: list[Tensor], step_them: Callable[[list[Tensor]], None]) -> None:
        super().__init__(params, {})
        self._params, self._step_them, self.stepped = params, step_them, False

    def step(self, closure: None = None) -> None:  # type: ignore[override]
        self._step_them(self._params)
        self.stepped = True


def _scale(grad: Tensor, coefficient: Tensor) -> None:
    local = grad.to_local() if isinstance(grad, DTensor) else grad
    local.mul_(coefficient.to(device=local.device, dtype=local.dtype))
