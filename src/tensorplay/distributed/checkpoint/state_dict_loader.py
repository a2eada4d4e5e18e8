"""``load``: PyTorch's DCP load, verified on every rank before anything is copied (all or nothing)."""

from __future__ import annotations

import os
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from torch.distributed.checkpoint import state_dict_loader as _torch_loader
from torch.distributed.checkpoint._storage_utils import _storage_setup
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.planner import LoadPlanner
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.checkpoint.storage import StorageReader

import tensorplay.distributed as dist
from tensorplay.distributed.checkpoint._errors import CheckpointError
from tensorplay.distributed.checkpoint._staged_read import StagedRead
from tensorplay.distributed.checkpoint.filesystem import FileSystemReader

__all__ = ["load", "load_state_dict"]


def _reader(checkpoint_id: str | os.PathLike | None, storage_reader: StorageReader | None,
            expected_digest: str | None = None) -> StorageReader:
    if storage_reader is None and checkpoint_id is not None:
        return FileSystemReader(checkpoint_id, expected_digest=expected_digest)
    reader = _storage_setup(storage_reader, checkpoint_id, reader=True)
    assert isinstance(reader, StorageReader)  # reader=True
    if expected_digest is not None:
        if not isinstance(reader, FileSystemReader):
            raise ValueError(f"load(expected_digest=...) needs tensorplay's FileSystemReader, which checks the pin; "
                             f"the storage_reader is a {type(reader).__module__}.{type(reader).__qualname__}")
        reader.expected_digest = expected_digest
    return reader


@contextmanager
def _staging(reader: StorageReader) -> Iterator[StagedRead | None]:
    if not isinstance(reader, FileSystemReader):
        yield None
        return
    reader.staged = StagedRead()
    try:
        yield reader.staged
    finally:
        reader.staged.close()
        reader.staged = None


def load(
    state_dict: dict[str, Any],
    *,
    checkpoint_id: str | os.PathLike | None = None,
    storage_reader: StorageReader | None = None,
    planner: LoadPlanner | None = None,
    process_group: dist.ProcessGroup | None = None,
    no_dist: bool = False,
    expected_digest: str | None = None,
) -> None:
    """Load a checkpoint into ``state_dict`` in place, as PyTorch's ``torch.distributed.checkpoint.load``.

    With our :class:`FileSystemReader` (the default for a ``checkpoint_id``): the
    metadata is read with an allow-list (no pickled code runs), every item this rank
    needs is checked against the manifest's CRC-32 (or its zip records' for a
    PyTorch checkpoint) and decoded with ``weights_only`` semantics; the ranks agree
    that all succeeded, and only then is anything copied. Otherwise every rank
    raises :class:`CheckpointError` naming each failing rank, its file and what is
    wrong, and ``state_dict`` (model and optimizer tensors) is untouched on every rank. Nothing outside
    the checkpoint directory is read, whatever its metadata says.

    ``expected_digest``: the pin :func:`save` returned (``metadata.manifest_digest``); a checkpoint whose
    manifest or metadata differ from the saved one is refused (see [Note: pinning a checkpoint]).

    Example:
        >>> import tensorplay as tp
        >>> import tensorplay.distributed.checkpoint as dcp
        >>> dcp.save({"weight": tp.arange(3.0), "step": 7}, checkpoint_id="ckpt")
        Metadata(...)
        >>> state = {"weight": tp.zeros(3), "step": 0}      # what to load, and where: loaded in place
        >>> dcp.load(state, checkpoint_id="ckpt")
        >>> state["weight"], state["step"]
        (tensor([0., 1., 2.]), 7)
    """
    no_dist = no_dist or not dist.is_available() or not dist.is_initialized()
    if no_dist:
        warnings.warn("torch.distributed is not initialized: loading in a single process", stacklevel=2)
    reader = _reader(checkpoint_id, storage_reader, expected_digest)
    planner = planner if planner is not None else DefaultLoadPlanner()
    keys = sorted(state_dict)
    plain = {k: state_dict[k].state_dict() if isinstance(state_dict[k], Stateful) else state_dict[k] for k in keys}
    with _staging(reader) as staged:
        try:
            _torch_loader._load_state_dict(plain, storage_reader=reader, process_group=process_group,
                                           no_dist=no_dist, planner=planner)
        except CheckpointException as error:
            where = getattr(reader, "checkpoint_id", checkpoint_id)
            raise CheckpointError.wrap(error, f"loading checkpoint {where} (nothing was loaded on any rank)",
                                       _refusal(reader, process_group, no_dist)) from None
        if staged is not None:
            staged.commit(planner)
    for key in keys:
        if isinstance(state_dict[key], Stateful):
            state_dict[key].load_state_dict(plain[key])
        else:
            state_dict[key] = plain[key]


def _refusal(reader: StorageReader, group: dist.ProcessGroup | None, no_dist: bool
             ) -> tuple[int, BaseException | None]:
    """This rank, and why our reader refused the checkpoint's metadata (None: it did not)."""
    rank = 0 if no_dist else dist.get_rank(group)
    return rank, reader.metadata_error if isinstance(reader, FileSystemReader) else None


def load_state_dict(
    state_dict: dict[str, Any],
    storage_reader: StorageReader,
    process_group: dist.ProcessGroup | None = None,
    coordinator_rank: int = 0,
    no_dist: bool = False,
    planner: LoadPlanner | None = None,
) -> None:
    """Deprecated in PyTorch (use :func:`load`); loads without the Stateful handling, verified like ``load``.

    Example:
        >>> import tensorplay as tp
        >>> import tensorplay.distributed.checkpoint as dcp
        >>> dcp.save({"weight": tp.ones(2)}, checkpoint_id="ckpt")
        Metadata(...)
        >>> state = {"weight": tp.zeros(2)}
        >>> dcp.load_state_dict(state, dcp.FileSystemReader("ckpt"))   # deprecated: use load()
        >>> state["weight"]
        tensor([1., 1.])
    """
    storage_reader.reset()
    planner = planner if planner is not None else DefaultLoadPlanner()
    with _staging(storage_reader) as staged:
        try:
            _torch_loader._load_state_dict(state_dict, storage_reader, process_group, coordinator_rank, no_dist,
                                           planner)
        except CheckpointException as error:
            raise CheckpointError.wrap(error, "loading checkpoint (nothing was loaded on any rank)") from None
        if staged is not None:
            staged.commit(planner)


def __getattr__(name: str) -> object:
    """Any other name of PyTorch's ``torch.distributed.checkpoint.state_dict_loader`` (the same object)."""
    import torch.distributed.checkpoint.state_dict_loader as torch_module

    try:
        return getattr(torch_module, name)
    except AttributeError:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None
