"""DDP communication hooks: how DDP reduces each gradient bucket.

Register one on a ``DistributedDataParallel`` model with
``model.register_comm_hook(state, hook)``. The plain hooks live in
:mod:`.default_hooks` (``allreduce_hook``, ``fp16_compress_hook``,
``bf16_compress_hook``); the post-local SGD hook in :mod:`.post_localSGD_hook`.
"""

from __future__ import annotations

from .default_hooks import (
    allreduce_hook,
    bf16_compress_hook,
    bf16_compress_wrapper,
    fp16_compress_hook,
    fp16_compress_wrapper,
)

__all__ = [
    "allreduce_hook",
    "bf16_compress_hook",
    "bf16_compress_wrapper",
    "fp16_compress_hook",
    "fp16_compress_wrapper",
]
