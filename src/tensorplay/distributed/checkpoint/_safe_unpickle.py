"""Read DCP's ``.metadata`` pickle without running code: only the classes its metadata is built from.

PyTorch's reader calls ``pickle.load`` on this file, so a planted object runs
whatever its ``__reduce__`` names. Ours resolves globals through an allow-list;
anything else is an :class:`UnsafeCheckpointError` naming the class and the file.
"""

from __future__ import annotations

import io
import pathlib
import pickle
from typing import Any

import torch

from tensorplay.distributed.checkpoint._errors import (
    CorruptCheckpointError,
    UnsafeCheckpointError,
)

_DCP = "torch.distributed.checkpoint"

#: (module, name) pairs DCP metadata is pickled from (PyTorch 2.13).
ALLOWED: frozenset[tuple[str, str]] = frozenset(
    [(f"{_DCP}.metadata", n) for n in ("Metadata", "TensorStorageMetadata", "TensorProperties",
                                       "ChunkStorageMetadata", "BytesStorageMetadata", "MetadataIndex",
                                       "StorageMeta", "_MEM_FORMAT_ENCODING")]
    + [(f"{_DCP}.filesystem", "_StorageInfo"), ("torch", "Size"), ("torch.serialization", "_get_layout"),
       ("collections", "OrderedDict"), ("builtins", "set"), ("builtins", "frozenset")]
    + [("pathlib", n) for n in ("Path", "PosixPath", "WindowsPath", "PurePath", "PurePosixPath", "PureWindowsPath")]
)


class _AllowListUnpickler(pickle.Unpickler):
    def __init__(self, file: io.BufferedIOBase, source: str) -> None:
        super().__init__(file)
        self._source = source

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in ALLOWED:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise UnsafeCheckpointError(
            f"{self._source}: the pickle asks for {module}.{name}, which is not among the classes checkpoint "
            f"metadata is made of; refusing to load it (it could run code). If you trust this file, load it "
            f"with torch.distributed.checkpoint instead.")


def load_metadata(data: bytes, source: str | pathlib.Path) -> Any:
    """Unpickle DCP metadata from ``data`` (read from ``source``, named in errors)."""
    try:
        return _AllowListUnpickler(io.BytesIO(data), str(source)).load()
    except UnsafeCheckpointError:
        raise
    except Exception as error:
        raise CorruptCheckpointError(f"{source}: cannot read checkpoint metadata ({error})") from error
