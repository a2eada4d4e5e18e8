"""The plain DDP communication hooks: average gradients, optionally in 16 bits.

Register one with ``ddp_model.register_comm_hook(process_group, hook)``; the
state is the process group to average over (``None`` means the default group).

DDP checks a hook's annotations by comparing them with ``dist.GradBucket`` and
``torch.futures.Future[torch.Tensor]``, so this module keeps real (not
postponed) annotations: no ``from __future__ import annotations`` here.
"""

from collections.abc import Callable
from typing import Any

import torch

import tensorplay.distributed as dist
from tensorplay.distributed._comm import collectives

from ._exit import settle_at_exit

__all__ = [
    "allreduce_hook",
    "bf16_compress_hook",
    "bf16_compress_wrapper",
    "fp16_compress_hook",
    "fp16_compress_wrapper",
]

Hook = Callable[[Any, dist.GradBucket], torch.futures.Future[torch.Tensor]]


def _group_or_world(process_group: dist.ProcessGroup | None) -> dist.ProcessGroup:
    # Hooks run under DDP, which needs the default group: WORLD exists here.
    group = process_group if process_group is not None else dist.group.WORLD
    if group is None:
        raise RuntimeError("DDP communication hooks need the default process group: call init_process_group first")
    settle_at_exit()  # this hook's future is completed on a backend thread: see [Note: hook futures at exit]
    return group


def _allreduce_fut(process_group: dist.ProcessGroup | None,
                   tensor: torch.Tensor) -> torch.futures.Future[torch.Tensor]:
    """Average ``tensor`` in place over ``process_group`` (``None``: the default group).

    Divides before summing, so a 16-bit tensor does not overflow. The future
    resolves to ``tensor`` itself.

    Example:
        >>> import tensorplay as tp
        >>> import tensorplay.distributed as dist
        >>> from tensorplay.distributed.algorithms.ddp_comm_hooks.default_hooks import _allreduce_fut
        >>> _allreduce_fut(dist.group.WORLD, tp.ones(3)).wait()    # the sum divided by the world size
        tensor([1., 1., 1.])
    """
    group = _group_or_world(process_group)
    tensor.div_(group.size())
    return collectives.all_reduce_future(tensor, group, where="DDP gradient bucket")


def allreduce_hook(process_group: dist.ProcessGroup | None,
                   bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Average the bucket's gradients over ``process_group``: what DDP does with no hook.

    Example:
        >>> import tensorplay as tp
        >>> from tensorplay.nn.parallel import DistributedDataParallel as DDP
        >>> from tensorplay.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
        >>> model = DDP(tp.nn.Linear(16, 4))
        >>> model.register_comm_hook(None, allreduce_hook)     # None: the default group
        >>> model(tp.randn(8, 16)).sum().backward()     # the hook reduces each gradient bucket
    """
    return _allreduce_fut(process_group, bucket.buffer())


def _compressed_allreduce(dtype: torch.dtype, process_group: dist.ProcessGroup | None,
                          bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Average a ``dtype`` copy of the bucket, then write it back into the bucket in place."""
    group = _group_or_world(process_group)
    buffer = bucket.buffer()
    compressed = buffer.to(dtype).div_(group.size())

    def decompress(fut: torch.futures.Future[list[torch.Tensor]]) -> torch.Tensor:
        return buffer.copy_(fut.value()[0])  # in place: no second full-precision buffer

    return collectives.watched_all_reduce_future(compressed, group, where="DDP gradient bucket (compressed)"
                                                 ).then(decompress)


def fp16_compress_hook(process_group: dist.ProcessGroup | None,
                       bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Average the gradients as ``float16`` (cast, divide by the group size, all-reduce, cast back).

    Example:
        >>> import tensorplay as tp
        >>> from tensorplay.nn.parallel import DistributedDataParallel as DDP
        >>> from tensorplay.distributed.algorithms.ddp_comm_hooks.default_hooks import fp16_compress_hook
        >>> model = DDP(tp.nn.Linear(16, 4))
        >>> model.register_comm_hook(None, fp16_compress_hook)   # gradients travel in float16
        >>> model(tp.randn(8, 16)).sum().backward()     # the hook reduces each gradient bucket
    """
    return _compressed_allreduce(torch.float16, process_group, bucket)


def _bf16_compress_hook(process_group: dist.ProcessGroup | None,
                        bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Average the gradients as ``bfloat16`` (cast, divide by the group size, all-reduce, cast back).

    Unlike PyTorch's hook of the same name, which DDP refuses to register
    without CUDA and NCCL 2.10+, this one also works on CPU with Gloo.

    Example:
        >>> import tensorplay as tp
        >>> from tensorplay.nn.parallel import DistributedDataParallel as DDP
        >>> from tensorplay.distributed.algorithms.ddp_comm_hooks.default_hooks import bf16_compress_hook
        >>> model = DDP(tp.nn.Linear(16, 4))
        >>> model.register_comm_hook(None, bf16_compress_hook)   # gradients travel in bfloat16
        >>> model(tp.randn(8, 16)).sum().backward()     # the hook reduces each gradient bucket
    """
    return _compressed_allreduce(torch.bfloat16, process_group, bucket)


# DDP refuses any hook whose ``__name__`` is "bf16_compress_hook" unless CUDA and
# NCCL 2.10+ are present, although Gloo reduces bfloat16 fine; the function keeps
# its own name so that it registers on CPU too.
bf16_compress_hook = _bf16_compress_hook


def _compress_wrapper(dtype: torch.dtype, hook: Hook) -> Hook:
    def compressed_hook(state: Any, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        bucket.set_buffer(bucket.buffer().to(dtype))
        fut = hook(state, bucket)

        def decompress(fut: torch.futures.Future[torch.Tensor]) -> torch.Tensor:
            return bucket.buffer().copy_(fut.value())

        return fut.then(decompress)

    short = {torch.float16: "fp16", torch.bfloat16: "bf16"}[dtype]
    compressed_hook.__name__ = compressed_hook.__qualname__ = f"{short}_compressed_{hook.__name__}"
    return compressed_hook


def fp16_compress_wrapper(hook: Hook) -> Hook:
    """Wrap ``hook`` so that it communicates ``float16`` and its result is cast back to the bucket's dtype.

    ``fp16_compress_wrapper(allreduce_hook)`` computes what ``fp16_compress_hook`` does.

    Example:
        >>> import tensorplay as tp
        >>> from tensorplay.nn.parallel import DistributedDataParallel as DDP
        >>> from tensorplay.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import PowerSGDState, powerSGD_hook
        >>> from tensorplay.distributed.algorithms.ddp_comm_hooks.default_hooks import fp16_compress_wrapper
        >>> model = DDP(tp.nn.Linear(16, 4))
        >>> state = PowerSGDState(process_group=None, matrix_approximation_rank=1, start_powerSGD_iter=2)
        >>> model.register_comm_hook(state, fp16_compress_wrapper(powerSGD_hook))   # PowerSGD in float16
        >>> model(tp.randn(8, 16)).sum().backward()     # the hook reduces each gradient bucket
    """
    return _compress_wrapper(torch.float16, hook)


def bf16_compress_wrapper(hook: Hook) -> Hook:
    """Wrap ``hook`` so that it communicates ``bfloat16`` and its result is cast back to the bucket's dtype.

    Works on CPU with Gloo, unlike PyTorch's wrapper (see :func:`bf16_compress_hook`).

    Example:
        >>> import tensorplay as tp
        >>> from tensorplay.nn.parallel import DistributedDataParallel as DDP
        >>> from tensorplay.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import PowerSGDState, powerSGD_hook
        >>> from tensorplay.distributed.algorithms.ddp_comm_hooks.default_hooks import bf16_compress_wrapper
        >>> model = DDP(tp.nn.Linear(16, 4))
        >>> state = PowerSGDState(process_group=None, matrix_approximation_rank=1, start_powerSGD_iter=2)
        >>> model.register_comm_hook(state, bf16_compress_wrapper(powerSGD_hook))   # PowerSGD in bfloat16
        >>> model(tp.randn(8, 16)).sum().backward()     # the hook reduces each gradient bucket
    """
    return _compress_wrapper(torch.bfloat16, hook)
