"""Distributed checkpoints with PyTorch's DCP API and safe defaults.

Code written for ``torch.distributed.checkpoint`` runs after changing only the
import. What differs is what ``save`` and ``load`` guarantee by default:

- ``save`` is atomic: the checkpoint appears complete (with a manifest of CRC-32s
  per file and per stored item) or not at all; a save killed midway leaves the
  previous checkpoint at that path loadable.
- ``load`` never runs pickled code (metadata through an allow-list, values with
  ``weights_only``), verifies every item it needs on every rank, and copies only
  when every rank succeeded: all or nothing, with an error on every rank naming the
  failing rank and file. PyTorch's checkpoints load too (checked against their zip
  records' CRC-32s, with a warning); ours load in PyTorch's DCP.

Planners, storage interfaces and metadata types are PyTorch's own objects.
"""

from __future__ import annotations

from torch.distributed.checkpoint import _extension  # noqa: F401  (as in PyTorch's package)
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import (
    DefaultLoadPlanner,
    DefaultSavePlanner,
)
from torch.distributed.checkpoint.hf_storage import (
    HuggingFaceStorageReader,
    HuggingFaceStorageWriter,
)
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.optimizer import load_sharded_optimizer_state_dict
from torch.distributed.checkpoint.planner import (
    LoadPlan,
    LoadPlanner,
    ReadItem,
    SavePlan,
    SavePlanner,
    WriteItem,
)
from torch.distributed.checkpoint.quantized_hf_storage import (
    QuantizedHuggingFaceStorageReader,
)
from torch.distributed.checkpoint.storage import StorageReader, StorageWriter

from tensorplay import _alias
from tensorplay.distributed.checkpoint._errors import (
    CheckpointError,
    CorruptCheckpointError,
    UnsafeCheckpointError,
)
from tensorplay.distributed.checkpoint.filesystem import (
    FileSystemReader,
    FileSystemWriter,
)
from tensorplay.distributed.checkpoint.state_dict_loader import load, load_state_dict
from tensorplay.distributed.checkpoint.state_dict_saver import (
    async_save,
    save,
    save_state_dict,
)

__all__ = [  # noqa: RUF022  (ours first, then PyTorch's objects)
    "save", "load", "async_save", "save_state_dict", "load_state_dict", "FileSystemReader", "FileSystemWriter",
    "CheckpointError", "CorruptCheckpointError", "UnsafeCheckpointError",
    "CheckpointException", "DefaultLoadPlanner", "DefaultSavePlanner", "HuggingFaceStorageReader",
    "HuggingFaceStorageWriter", "QuantizedHuggingFaceStorageReader", "BytesStorageMetadata", "ChunkStorageMetadata",
    "Metadata", "TensorStorageMetadata", "load_sharded_optimizer_state_dict", "LoadPlan", "LoadPlanner", "ReadItem",
    "SavePlan", "SavePlanner", "WriteItem", "StorageReader", "StorageWriter",
]


def __getattr__(name: str) -> object:
    return _alias.alias_attribute(__name__, name)
