"""DDP communication hooks: how DDP reduces each gradient bucket.

Register one on a ``DistributedDataParallel`` model with
``model.register_comm_hook(state, hook)``. The plain hooks live in
:mod:`.default_hooks` (``allreduce_hook``, ``fp16_compress_hook``,
``bf16_compress_hook``, re-exported here); the post-local SGD hook in
:mod:`.post_localSGD_hook` (``PostLocalSGDState`` is re-exported; the function
``post_localSGD_hook.post_localSGD_hook`` is not, because its name is the
module's and PyTorch users import the module by that path).
"""

from __future__ import annotations

from . import default_hooks, post_localSGD_hook
from .default_hooks import (
    allreduce_hook,
    bf16_compress_hook,
    bf16_compress_wrapper,
    fp16_compress_hook,
    fp16_compress_wrapper,
)
from .post_localSGD_hook import PostLocalSGDState

__all__ = [
    "PostLocalSGDState",
    "allreduce_hook",
    "bf16_compress_hook",
    "bf16_compress_wrapper",
    "default_hooks",
    "fp16_compress_hook",
    "fp16_compress_wrapper",
    "post_localSGD_hook",
]
