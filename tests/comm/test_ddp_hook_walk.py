"""The walk of one DDP ``allreduce_hook`` call: it decides once how the bytes travel and enters the transport
module once (counted with ``sys.setprofile`` on 2 Gloo ranks, through shared memory and natively)."""

from __future__ import annotations

import sys
from types import FrameType
from typing import Any

import torch

import tensorplay.distributed as dist
from tensorplay.distributed._comm import collectives, host_memory
from tensorplay.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from tensorplay.testing.distributed import run_distributed

TRANSPORT = host_memory.__file__
DECISIONS = {"_sum_in_host_memory"}  # before: "_all_reduce_in_host_memory" (asked twice per call)


class _Bucket:
    """What ``allreduce_hook`` reads of a ``GradBucket``: its flat buffer."""

    def __init__(self, buffer: torch.Tensor) -> None:
        self._buffer = buffer

    def buffer(self) -> torch.Tensor:
        return self._buffer


def _count_walk(numel: int) -> dict[str, Any]:
    """Entries into the transport module (calls into it from outside it) and decisions, for one hook call."""
    counts = {"entries": 0, "decisions": 0}

    def profile(frame: FrameType, event: str, arg: object) -> None:
        if event != "call":
            return
        caller = frame.f_back
        if frame.f_code.co_filename == TRANSPORT and (caller is None or caller.f_code.co_filename != TRANSPORT):
            counts["entries"] += 1
        if frame.f_code.co_filename == collectives.__file__ and frame.f_code.co_name in DECISIONS:
            counts["decisions"] += 1

    grads = torch.full((numel,), float(dist.get_rank() + 1))
    allreduce_hook(None, _Bucket(grads.clone())).wait()  # warm: the first call finds the arena (a collective)
    bucket = _Bucket(grads.clone())
    sys.setprofile(profile)
    try:
        result = allreduce_hook(None, bucket).wait()
    finally:
        sys.setprofile(None)
    return {**counts, "mean": result.unique().tolist(), "in_place": result.data_ptr() == bucket.buffer().data_ptr()}


def _walks() -> dict[str, dict[str, Any]]:
    return {"shared_memory": _count_walk(1 << 15), "native": _count_walk(16)}  # 128 KiB and 64 B of fp32


def test_one_allreduce_hook_call_decides_once_and_enters_the_transport_once() -> None:
    for rank, walks in enumerate(run_distributed(_walks, world_size=2)):
        shared, native = walks["shared_memory"], walks["native"]
        assert shared["mean"] == [1.5] and native["mean"] == [1.5] and shared["in_place"], (rank, walks)
        assert (shared["entries"], shared["decisions"]) == (1, 1), (rank, walks)
        assert (native["entries"], native["decisions"]) == (0, 1), (rank, walks)
