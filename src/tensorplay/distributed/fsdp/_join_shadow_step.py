"""Uneven inputs under ``Join`` for fully_shard and the classic wrapper.

[Note: join by shadow step]
Under ``Join([model], optimizer=optim)`` a rank whose data ran out keeps
taking part in the others' steps until every rank has run out. Each such
shadow step reruns this rank's last batch through the model with zero
gradients flowing back (``autograd.backward(outputs, zeros)``): the forward
issues every unit's all-gather in forward order, the backward the all-gathers
and reduce-scatters in backward order, exactly as a real step of this rank
does, and the reduce-scatters add exact zeros. The gradient each rank then
holds is the sum over the ranks that still had data divided by the full world
size: DDP's default under ``Join`` (``divide_by_initial_world_size=True``).
Unlike DDP, whose joined ranks idle and get the final model broadcast at the
end, every rank owns a shard here, so the joined rank must also step its
optimizer on the averaged gradients (``optimizer``: the optimizer, or a
callable that runs the whole step, e.g. gradient clipping, ``step()`` and a
learning-rate scheduler). Buffers (batch-norm statistics) are restored after
the shadow forward, and gradients are cleared before it, as a loop that calls
``zero_grad()`` every step would.

``Join`` counts the ranks with data on one group: the sharding group, or for
hybrid sharding (shard and replicate groups) the world, which they must make up.
Not supported (a ``ValueError`` says so): ``divide_by_initial_world_size=False``
(dividing by the number of ranks with data), hybrid groups that are only part of
the world, and a rank that runs out before its first forward (nothing to rerun).
Not supported and not detected: a step of several forwards (gradient
accumulation), since the shadow step runs one forward.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, cast

import torch
from torch import nn
from torch.utils._pytree import tree_leaves

import tensorplay.distributed as dist
from tensorplay.distributed.algorithms.join import Join, Joinable, JoinHook

_HOOK_ATTR = "_join_shadow_hook"  # the module's current ShadowStepHook (a later Join replaces it)


class ShardedJoinable:
    """Makes a sharded module a ``Joinable``; the front end says which group and device ``Join`` uses."""

    def join_hook(self, **kwargs: Any) -> JoinHook:
        """The hook a rank with no inputs left runs once per step of the others (see [Note: join by shadow step])."""
        return ShadowStepHook(cast(nn.Module, self), **kwargs)

    @property
    def join_device(self) -> torch.device:
        return self._join_group_and_device()[1]

    @property
    def join_process_group(self) -> Any:
        return self._join_group_and_device()[0]

    def _join_group_and_device(self) -> tuple[Any, torch.device]:
        raise NotImplementedError


def hybrid_join_group(data_parallel_size: int, what: str) -> Any:
    """The group ``Join`` counts ranks on when gradients go through two groups (HSDP): the world, which they span."""
    world = dist.get_world_size()
    if data_parallel_size != world:
        raise ValueError(f"Join with {what}: its shard and replicate groups span {data_parallel_size} of the "
                         f"{world} ranks; Join needs one group of all data-parallel ranks (the world)")
    return dist.group.WORLD


# A virtual subclass: Joinable's ABC metaclass stays off the module classes.
Joinable.register(ShardedJoinable)


def _step_of(optimizer: Any) -> Callable[[], object]:
    if optimizer is None:
        raise ValueError("Join([fsdp_model], ...) needs the optimizer: pass Join([model], optimizer=optim) (or a "
                         "callable that runs the whole step): a rank that ran out of inputs still updates its shard")
    if isinstance(optimizer, torch.optim.Optimizer):
        return optimizer.step
    if callable(optimizer):
        return cast(Callable[[], object], optimizer)
    raise TypeError(f"Join(..., optimizer=...) must be a torch.optim.Optimizer or a callable running the step, "
                    f"got {type(optimizer).__name__}")


class ShadowStepHook(JoinHook):
    """Reruns the last batch with zero gradients while other ranks still have data; see [Note: join by shadow step]."""

    module: nn.Module
    step: Callable[[], object]
    last_inputs: tuple[tuple, dict] | None  # the last forward's (args, kwargs)
    shadowing: bool  # a shadow forward is running: it must not count as a real step
    notify_work: Any  # Join's "still have data" all-reduce of the last real forward

    def __init__(self, module: nn.Module, *, optimizer: Any = None, divide_by_initial_world_size: bool = True,
                 **_others: Any) -> None:
        if not divide_by_initial_world_size:
            raise ValueError(f"Join(..., divide_by_initial_world_size=False) is not supported with "
                             f"{type(module).__name__}: its gradients are divided by the full world size "
                             f"(DDP's default under Join); leave the argument at True")
        self.module, self.step = module, _step_of(optimizer)
        self.last_inputs, self.shadowing, self.notify_work = None, False, None
        previous = module.__dict__.get(_HOOK_ATTR)
        if previous is not None:  # an earlier Join that raised or was disabled never ran its post-hook
            previous.close()
        self._handle = module.register_forward_pre_hook(self._on_forward, prepend=True, with_kwargs=True)
        module.__dict__[_HOOK_ATTR] = self

    def _on_forward(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        """Before the front end's own hooks: tell ``Join`` this rank has data, and keep the inputs for shadowing."""
        config = module.__dict__.get("_join_config")  # set by Join on its joinables
        if self.shadowing or config is None or not config.enable:
            return
        if self.notify_work is not None:
            self.notify_work.wait()
        self.notify_work = Join.notify_join_context(cast(Joinable, module))
        self.last_inputs = (args, kwargs)

    def main_hook(self) -> None:
        args, kwargs = self._inputs()
        for param in self.module.parameters():
            param.grad = None
        buffers = [(buffer, buffer.detach().clone()) for buffer in self.module.buffers()]
        self.shadowing = True
        try:
            with torch.enable_grad():
                outputs = [t for t in tree_leaves(self.module(*args, **kwargs))
                           if isinstance(t, torch.Tensor) and t.requires_grad]
                if not outputs:
                    raise RuntimeError(f"rank {dist.get_rank()}: Join's shadow step of {type(self.module).__name__} "
                                       f"got no output that requires grad, so it cannot run the backward the "
                                       f"other ranks run; return the tensors the loss is computed from")
                torch.autograd.backward(outputs, [torch.zeros_like(t) for t in outputs])
        finally:
            self.shadowing = False
            with torch.no_grad():
                for buffer, saved in buffers:
                    buffer.copy_(saved)
        self.step()

    def _inputs(self) -> tuple[tuple, dict]:
        if self.last_inputs is None:
            raise ValueError(f"rank {dist.get_rank()} ran out of inputs under Join before its first forward of "
                             f"{type(self.module).__name__}: give every rank at least one batch")
        return self.last_inputs

    def post_hook(self, is_last_joiner: bool) -> None:
        self.close()

    def close(self) -> None:
        """Stop counting forwards for ``Join``: remove the pre-forward hook and drop the kept inputs."""
        if self.notify_work is not None:
            self.notify_work.wait()
        self._handle.remove()
        self.last_inputs, self.notify_work = None, None
        if self.module.__dict__.get(_HOOK_ATTR) is self:
            del self.module.__dict__[_HOOK_ATTR]
