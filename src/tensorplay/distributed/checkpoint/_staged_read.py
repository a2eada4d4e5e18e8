"""Read, verify and decode a rank's share of a checkpoint into a staging area; copy in place later.

[Note: all-or-nothing load]
PyTorch's reader copies each tensor into the model as soon as it is read, so an
error in the fifth file leaves four loaded, and a damaged shard on rank 1 leaves
rank 0 fully loaded. Ours reads every item this rank needs, checks its CRC-32
against the manifest (or, for a PyTorch checkpoint, the zip records' CRC-32s),
decodes it with ``weights_only`` semantics and checks its shape against the
destination, holding the decoded values here. DCP's read step ends with an
all-gather of every rank's outcome (its agreement: one collective, an error on any
rank is raised on all); only when every rank succeeded does ``load`` call
:meth:`StagedRead.commit`, which copies. The cost: the decoded values of one rank's
share are held at once (PyTorch's reader holds one at a time).
"""

from __future__ import annotations

import io
import pickle
from dataclasses import dataclass, field
from typing import IO

import torch
from torch.distributed.checkpoint.planner import LoadPlanner, ReadItem

from tensorplay.distributed.checkpoint._errors import (
    CorruptCheckpointError,
    UnsafeCheckpointError,
)

__all__ = ["StagedRead", "decode_blob", "decode_tensor"]


@dataclass
class StagedRead:
    """Decoded values waiting for every rank to succeed."""

    tensors: list[tuple[ReadItem, torch.Tensor, torch.Tensor]] = field(default_factory=list)  # (item, dest, value)
    blobs: list[tuple[ReadItem, bytes]] = field(default_factory=list)

    def commit(self, planner: LoadPlanner) -> None:
        for item, dest, value in self.tensors:
            dest.copy_(value)
            planner.commit_tensor(item, dest)
        for item, raw in self.blobs:
            planner.load_bytes(item, io.BytesIO(raw))  # bytes that passed a weights_only decode
        self.tensors.clear()
        self.blobs.clear()


def _safe_torch_load(stream: IO[bytes], where: str) -> object:
    try:
        return torch.load(stream, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as error:
        raise UnsafeCheckpointError(f"{where}: refused by the weights_only loader: {error}") from None
    except Exception as error:  # noqa: BLE001 - anything else is damaged bytes
        raise CorruptCheckpointError(f"{where}: cannot decode ({type(error).__name__}: {error})") from None


def decode_blob(stream: IO[bytes], where: str) -> None:
    """Check that a non-tensor item decodes under ``weights_only`` (the planner decodes it again at commit)."""
    _safe_torch_load(stream, where)


def decode_tensor(stream: IO[bytes], where: str) -> torch.Tensor:
    value = _safe_torch_load(stream, where)
    if not isinstance(value, torch.Tensor):
        raise CorruptCheckpointError(f"{where}: expected a tensor, found {type(value).__name__}")
    return value
