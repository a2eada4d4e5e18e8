"""A failed async_save fails as save does, on every rank: its staging directory goes, result() raises it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

import tensorplay.distributed as dist
import tensorplay.distributed.checkpoint as dcp
from tensorplay.distributed.checkpoint import CheckpointError
from tensorplay.testing.distributed import run_distributed

from tests.common import disk_full_after

ITEM = torch.arange(64 * 1024, dtype=torch.float32)  # 256 KiB


def full_disk_on_rank_one(root: str) -> dict[str, Any]:
    """Rank 1's disk fills mid-write; every rank waits on its future, then lists the directory."""
    from tensorplay.distributed.checkpoint import _write_checksums

    stream = _write_checksums.ChecksummingStream
    real_write = stream.write
    state = {f"w_{dist.get_rank()}": ITEM + dist.get_rank()}  # one item per rank: each rank writes its own
    if dist.get_rank() == 1:
        stream.write = disk_full_after(real_write)  # type: ignore[method-assign]  # a pooled worker: restored below
    try:
        future = dcp.async_save(state, checkpoint_id=Path(root) / "ckpt")
        try:
            future.result(timeout=60)
            outcome = ("no error", "", "")
        except CheckpointError as error:
            (cause, _), = error.failures.values()
            outcome = (type(error).__name__, str(error), str(cause))
    finally:
        stream.write = real_write  # type: ignore[method-assign]
    dist.barrier()  # every rank's cleanup has run before anyone looks
    return {"outcome": outcome, "listing": sorted(p.name for p in Path(root).iterdir())}


def test_a_failed_async_save_removes_its_staging_on_every_rank_and_raises_the_named_error(tmp_path):
    for rank, got in enumerate(run_distributed(full_disk_on_rank_one, str(tmp_path), world_size=2)):
        kind, message, cause = got["outcome"]
        assert kind == "CheckpointError", (rank, got)
        assert message.startswith(f"saving checkpoint {tmp_path / 'ckpt'} failed on rank(s) 1"), (rank, message)
        assert cause.startswith(f"[Errno 28] no space left on {tmp_path}: needed ~"), (rank, cause)
        assert got["listing"] == [], (rank, got["listing"])  # no .ckpt.saving-* on any rank
