"""When the optimizers of one ``apply_optimizer_in_backward`` call step: accumulation and clipping.

Each front end reports a parameter whose gradient is final for this backward
(:meth:`InBackwardGroup.grad_ready`): a plain module from a post-accumulate-grad
hook, fully_shard once the parameter's reduce-scatter has landed (its
``.grad`` then is the sharded gradient), classic FSDP once its unit's shard
is reduced, DDP once its bucket is averaged. The group decides:

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
``_options.py``.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from torch import Tensor
from torch.autograd import Variable
from torch.distributed.tensor import DTensor

import tensorplay.distributed as dist
from tensorplay.distributed._comm.agreement import agree
from tensorplay.distributed.optim.in_backward._clip import NormPart, clip_coefficient, local_norm_part
from tensorplay.distributed.optim.in_backward._options import InBackwardOptions

__all__ = ["LAST_NORM_KEY", "InBackwardGroup", "direct_steps"]

#: The param-group key under which ``"previous"`` clipping keeps the last step's global norm (a float32 0-dim
#: tensor, NaN before the first step), so that it is saved and loaded with the optimizers: a resumed run clips
#: its first step as the uninterrupted one would. (A param-group entry, not per-parameter state: optimizers
#: initialise a parameter's state when it is empty.)
LAST_NORM_KEY = "in_backward_last_norm"


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
        self._ranks: tuple[object, ...] = ()  # the groups of the ranks training the parameters, if told
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
        if self.options.clip_mode == "previous" and isinstance(optimizer, torch.optim.Optimizer):
            for group in optimizer.param_groups:  # a template to load a saved norm into
                group.setdefault(LAST_NORM_KEY, torch.full((), math.nan, device=param.device))
            optimizer.register_load_state_dict_post_hook(self._load_last_norm)

    # ---- events ---------------------------------------------------------------------------------
    def grad_ready(self, param: Tensor, shard_groups: tuple[object, ...] = (),
                   ranks: tuple[object, ...] = ()) -> bool:
        """``param.grad`` is final for this backward; True when the gradient must be kept (not freed).

        ``shard_groups``: the groups a plain-tensor gradient is a shard over (classic FSDP), for the norm.
        ``ranks``: groups that together hold every rank training ``param`` (DDP's group, classic FSDP's
        shard and replicate groups), for the accumulation check; a DTensor's mesh says it itself.
        """
        self._queue_end_of_backward()
        self._shard_groups[param] = shard_groups
        if ranks:
            self._ranks = ranks
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

    def accumulating(self, param: Tensor) -> bool:
        """Whether ``param``'s gradient is kept for a later backward to accumulate into."""
        return self._deliveries.get(param, 0) > 0

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
        if self.options.clip_mode == "previous":  # the next step needs it: checkpointed with the optimizers
            saved = norm.detach().float()
            for optimizers in self._optimizers.values():
                for optimizer in optimizers:
                    for group in getattr(optimizer, "param_groups", ()):
                        group[LAST_NORM_KEY] = saved

    def _load_last_norm(self, optimizer: torch.optim.Optimizer) -> None:
        """After ``optimizer.load_state_dict``: take the saved norm as the previous step's (every optimizer of
        the group saved the same one)."""
        norm = optimizer.param_groups[0].get(LAST_NORM_KEY)
        if norm is None or bool(torch.isnan(norm)):
            self.last_norm = self.last_coefficient = None
            return
        assert self.options.max_norm is not None  # "previous" has one
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
                               "clipping are applied there), not by calling step() directly; a front end "
                               "that sets .grad itself hands it over with grad_ready(param)")

    @contextlib.contextmanager
    def _stepped_directly(self) -> Iterator[None]:
        stepping, self._stepping = self._stepping, True
        try:
            yield
        finally:
            self._stepping = stepping

    # ---- checks ---------------------------------------------------------------------------------
    def _check_accumulation_across_ranks(self) -> None:
        """Per group of :meth:`_rank_groups` (equal within each group that links the ranks is equal across
        them): one agreement on K on the first backward (see [Note: agreement])."""
        for group in self._rank_groups():
            self._check_accumulation_within(group)

    def _check_accumulation_within(self, group: Any) -> None:
        steps = self.options.accumulation_steps
        agreement = agree("apply_optimizer_in_backward accumulation_steps", False, group, values=[steps],
                          device=self._device())
        if not agreement.differing():
            return
        per_rank = {agreement.global_rank(i): values[0] for i, values in enumerate(agreement.values)}
        differing = sorted(r for r, k in per_rank.items() if k != steps)
        raise ValueError(f"apply_optimizer_in_backward: InBackwardOptions.accumulation_steps differs across ranks: "
                         f"rank {dist.get_rank()} has {steps}, rank(s) {differing} have "
                         f"{[per_rank[r] for r in differing]} (all ranks: {per_rank}); every rank must accumulate "
                         "the same number of micro-batches")

    def _rank_groups(self) -> tuple[Any, ...]:
        """The groups linking the ranks that train these parameters: each dimension of a DTensor's mesh, the
        groups the front end named (``grad_ready``'s ``ranks``), else the default group; none without a
        process group or accumulation. (Never the default group when the front end runs on a subgroup: the
        ranks outside it would never join.)"""
        param = next(iter(self._optimizers), None)
        if isinstance(param, DTensor):
            mesh = param.device_mesh
            return tuple(mesh.get_group(dim) for dim in range(mesh.ndim))
        if self.options.accumulation_steps == 1 or not dist.is_initialized():
            return ()
        return self._ranks or (dist.group.WORLD,)

    def _device(self) -> torch.device:
        param = next(iter(self._optimizers))
        return param.device


@contextlib.contextmanager
def direct_steps(optimizers: Iterable[Any]) -> Iterator[None]:
    """Let the in-backward optimizers among ``optimizers`` be stepped by a direct ``step()`` call (options
    refuse one otherwise): for a checkpoint's template step, zero gradients at lr 0, that creates the state to
    load into."""
    groups: dict[int, InBackwardGroup] = {}
    for optimizer in optimizers:
        for group in getattr(optimizer, "param_groups", ()):
            for param in group["params"]:
                groups.update((id(g), g) for g in getattr(param, "_in_backward_groups", ()))
    with contextlib.ExitStack() as stack:
        for group in groups.values():
            stack.enter_context(group._stepped_directly())
        yield


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
