"""A DDP hook that communicates nothing, for measuring how much gradient communication costs.

    ddp_model.register_comm_hook(None, noop_hook)

Each rank keeps its own gradients, so the replicas drift apart: use it only to
measure headroom (if training is barely faster without communication, the
all-reduce is not the bottleneck), never to train.

DDP compares hook annotations with ``dist.GradBucket`` and
``torch.futures.Future[torch.Tensor]``, so this module keeps real annotations.
"""

from typing import Any

import torch

from tensorplay.distributed import GradBucket

__all__ = ["noop_hook"]


def noop_hook(_: Any, bucket: GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Resolve at once to the bucket's own (local, un-averaged) gradients.

    Example:
        >>> import tensorplay as tp
        >>> from tensorplay.nn.parallel import DistributedDataParallel as DDP
        >>> from tensorplay.distributed.algorithms.ddp_comm_hooks.debugging_hooks import noop_hook
        >>> model = DDP(tp.nn.Linear(16, 4))
        >>> model.register_comm_hook(None, noop_hook)   # no communication: measures what the all-reduce costs
        >>> model(tp.randn(8, 16)).sum().backward()     # the hook reduces each gradient bucket
    """
    fut: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    fut.set_result(bucket.buffer())
    return fut
