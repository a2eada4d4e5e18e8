"""The post-local SGD DDP hook: global gradient averaging, then only within a subgroup.

Like :mod:`.default_hooks`, this module keeps real annotations (no postponed
``from __future__ import annotations``) because DDP compares a hook's
annotations with ``dist.GradBucket`` and ``torch.futures.Future[torch.Tensor]``.
"""

import logging

import torch

import tensorplay.distributed as dist
from tensorplay.distributed._checks.validation import check_bool, check_int, check_process_group
from tensorplay.distributed._sharding.devices import ranks_per_node

from .default_hooks import _allreduce_fut

__all__ = ["PostLocalSGDState", "post_localSGD_hook"]

logger = logging.getLogger(__name__)

_UNKNOWN_NODE_SIZE = (
    "PostLocalSGDState(subgroup=None) averages within each machine, but the number of ranks per machine "
    "is unknown: LOCAL_WORLD_SIZE is not set (torchrun sets it) and there is no accelerator. "
    "Pass subgroup=, e.g. dist.new_subgroups(group_size=...)[0]")


def _ranks_per_node() -> int:
    """How many ranks share this machine: torchrun's ``LOCAL_WORLD_SIZE``, else the accelerator count."""
    size = ranks_per_node()
    if size is None:
        raise ValueError(_UNKNOWN_NODE_SIZE)
    world_size = dist.get_world_size() if dist.is_initialized() else size
    if size < 1 or world_size % size != 0:
        raise ValueError(f"PostLocalSGDState(subgroup=None) makes one subgroup per machine of {size} ranks, "
                         f"which does not divide the world size {world_size}: pass subgroup= explicitly")
    return size


class PostLocalSGDState:
    """The state of :func:`post_localSGD_hook`.

    For the first ``start_localSGD_iter`` iterations the hook averages the
    gradients over ``process_group`` (``None``: the default group), as plain DDP
    does; afterwards over ``subgroup`` only, or not at all when
    ``post_local_gradient_allreduce`` is False. Then a model averager (e.g.
    ``PeriodicModelAverager(period, warmup_steps=start_localSGD_iter)``) averages
    the parameters globally now and then.

    ``subgroup=None`` means one subgroup per machine, created at the first
    post-local iteration. Unlike PyTorch, which derives the machine's size from
    the CUDA device count (and so fails on CPU), its size is ``LOCAL_WORLD_SIZE``
    when set, else the accelerator count; and it is checked here, not at
    iteration ``start_localSGD_iter``.

    Example:
        >>> import tensorplay as tp
        >>> from tensorplay.nn.parallel import DistributedDataParallel as DDP
        >>> from tensorplay.distributed.algorithms.ddp_comm_hooks.post_localSGD_hook import (
        ...     PostLocalSGDState, post_localSGD_hook)
        >>> model = DDP(tp.nn.Linear(16, 4))
        >>> state = PostLocalSGDState(process_group=None, subgroup=None, start_localSGD_iter=100)
        >>> model.register_comm_hook(state, post_localSGD_hook)   # global all-reduce until step 100, then local
        >>> model(tp.randn(8, 16)).sum().backward()     # the hook reduces each gradient bucket
    """

    __slots__ = ["process_group", "subgroup", "start_localSGD_iter", "post_local_gradient_allreduce", "iter",
                 "_subgroup_size"]

    def __init__(self, process_group: dist.ProcessGroup | None, subgroup: dist.ProcessGroup | None,
                 start_localSGD_iter: int, post_local_gradient_allreduce: bool = True) -> None:
        where = "PostLocalSGDState"
        check_process_group(process_group, "process_group", where)
        check_process_group(subgroup, "subgroup", where)
        start = check_int(start_localSGD_iter, "start_localSGD_iter", where, minimum=0)
        check_bool(post_local_gradient_allreduce, "post_local_gradient_allreduce", where)
        self.process_group = process_group
        self.subgroup = subgroup
        self.start_localSGD_iter = start
        self.post_local_gradient_allreduce = post_local_gradient_allreduce
        self.iter = 0
        self._subgroup_size = (_ranks_per_node() if subgroup is None and post_local_gradient_allreduce
                               else None)
        logger.info("Local SGD will be started after %s iterations", start)

    def maybe_increase_iter(self, bucket: dist.GradBucket) -> None:
        """Count an iteration when its last bucket is reduced (DDP reduces bucket 0 last)."""
        if bucket.is_last():
            self.iter += 1
        if self.iter == self.start_localSGD_iter:
            logger.info("Start to apply local SGD after %s iterations.", self.iter)

    def local_group(self) -> dist.ProcessGroup:
        """The subgroup of the post-local phase, creating the per-machine one on first use."""
        if self.subgroup is None:
            self.subgroup, _ = dist.new_subgroups(group_size=self._subgroup_size)
        return self.subgroup


def post_localSGD_hook(state: PostLocalSGDState,
                       bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP communication hook for post-local SGD (see :class:`PostLocalSGDState`).

    Register with ``ddp_model.register_comm_hook(state, post_localSGD_hook)`` and
    average the parameters after each optimizer step with a model averager
    (or use ``PostLocalSGDOptimizer``).

    Example:
        >>> import tensorplay as tp
        >>> from tensorplay.nn.parallel import DistributedDataParallel as DDP
        >>> from tensorplay.distributed.algorithms.ddp_comm_hooks.post_localSGD_hook import (
        ...     PostLocalSGDState, post_localSGD_hook)
        >>> model = DDP(tp.nn.Linear(16, 4))
        >>> state = PostLocalSGDState(process_group=None, subgroup=None, start_localSGD_iter=100)
        >>> model.register_comm_hook(state, post_localSGD_hook)   # global all-reduce until step 100, then local
        >>> model(tp.randn(8, 16)).sum().backward()     # the hook reduces each gradient bucket
    """
    gradients = bucket.buffer()  # 1D flat
    if state.iter < state.start_localSGD_iter:
        state.maybe_increase_iter(bucket)
        return _allreduce_fut(state.process_group, gradients)
    if not state.post_local_gradient_allreduce:
        unchanged: torch.futures.Future[torch.Tensor] = torch.futures.Future()
        unchanged.set_result(gradients)
        return unchanged
    return _allreduce_fut(state.local_group(), gradients)
