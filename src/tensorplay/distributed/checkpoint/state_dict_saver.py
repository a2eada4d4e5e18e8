"""``save`` / ``async_save``: PyTorch's DCP save with our atomic, checksummed ``FileSystemWriter`` by default."""

from __future__ import annotations

import os
from concurrent.futures import Future
from typing import Any

from torch.distributed.checkpoint import state_dict_saver as _torch_saver
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import STATE_DICT_TYPE, Metadata
from torch.distributed.checkpoint.planner import SavePlanner
from torch.distributed.checkpoint.state_dict_saver import (
    AsyncCheckpointerType,
    AsyncSaveResponse,
)
from torch.distributed.checkpoint.storage import StorageWriter

import tensorplay.distributed as dist
from tensorplay.distributed.checkpoint._errors import CheckpointError
from tensorplay.distributed.checkpoint.filesystem import FileSystemWriter

__all__ = ["AsyncCheckpointerType", "AsyncSaveResponse", "async_save", "save", "save_state_dict"]


def _writer(checkpoint_id: str | os.PathLike | None, storage_writer: StorageWriter | None) -> StorageWriter | None:
    if storage_writer is None and checkpoint_id is not None:
        return FileSystemWriter(checkpoint_id)
    return storage_writer


def save(
    state_dict: STATE_DICT_TYPE,
    *,
    checkpoint_id: str | os.PathLike | None = None,
    storage_writer: StorageWriter | None = None,
    planner: SavePlanner | None = None,
    process_group: dist.ProcessGroup | None = None,
    no_dist: bool = False,
    use_collectives: bool = True,
) -> Metadata:
    """Save ``state_dict`` as PyTorch's ``torch.distributed.checkpoint.save`` does, atomically.

    With a ``checkpoint_id`` and no ``storage_writer``, the writer is our
    :class:`FileSystemWriter`: the checkpoint appears at ``checkpoint_id`` complete
    (with its manifest of checksums) or not at all; a previous checkpoint there is
    replaced in one step. A failure on any rank raises :class:`CheckpointError` on
    every rank; a rank that dies mid-save makes the others' collectives fail, which
    they raise as a :class:`CheckpointError` too (the previous checkpoint stays). The returned metadata's
    ``manifest_digest`` pins the checkpoint: pass it to ``load(..., expected_digest=...)``.

    Example:
        >>> import tensorplay as tp
        >>> import tensorplay.distributed.checkpoint as dcp
        >>> model = tp.nn.Linear(4, 2)
        >>> dcp.save({"model": model.state_dict(), "step": 10}, checkpoint_id="ckpt/step_10")
        Metadata(...)
    """
    writer = _writer(checkpoint_id, storage_writer)
    try:
        return _torch_saver.save(state_dict, checkpoint_id=checkpoint_id, storage_writer=writer, planner=planner,
                                 process_group=process_group, no_dist=no_dist, use_collectives=use_collectives)
    except BaseException as error:
        failure = _failure(error, writer, checkpoint_id, process_group)
        if failure is error:
            raise
        raise failure  # noqa: B904 - _failure chose the cause (PyTorch's wrapper hidden, a collective's kept)


def _failure(error: BaseException, writer: StorageWriter | None, checkpoint_id: str | os.PathLike | None,
             process_group: dist.ProcessGroup | None) -> BaseException:
    """What a failed save raises, once its staging directory is gone on this rank (``save`` and ``async_save``)."""
    _discard(writer)
    if isinstance(error, CheckpointError):
        return error
    if isinstance(error, CheckpointException):
        wrapped = CheckpointError.wrap(error, f"saving checkpoint {checkpoint_id or ''}")
        wrapped.__suppress_context__ = True
        return wrapped
    if isinstance(error, (RuntimeError, dist.DistError)):  # a collective broke: a peer died or timed out
        rank = dist.get_rank(process_group) if dist.is_initialized() else 0
        wrapped = CheckpointError(f"saving checkpoint {checkpoint_id or ''} failed on rank(s) {rank}: a collective "
                                  f"of the save failed (did another rank die?); any previous checkpoint there is "
                                  f"unchanged", {rank: (error, error.__traceback__)})
        wrapped.__cause__ = error
        return wrapped
    return error


def _discard(writer: StorageWriter | None) -> None:
    """A failed save's staging directory goes on every rank, whatever failed: a full disk must not stay full."""
    if isinstance(writer, FileSystemWriter):
        writer.discard_staging()


def _settled_as_save(upload: Future, writer: StorageWriter | None, checkpoint_id: str | os.PathLike | None,
                     process_group: dist.ProcessGroup | None) -> Future:
    """``upload``'s outcome, a failure handled as :func:`save` handles it (staging removed, the same error)."""
    settled: Future = Future()

    def settle(done: Future) -> None:
        if done.cancelled():
            settled.cancel()
            return
        error = done.exception()
        if error is None:
            settled.set_result(done.result())
        else:
            settled.set_exception(_failure(error, writer, checkpoint_id, process_group))

    upload.add_done_callback(settle)
    return settled


def async_save(
    state_dict: STATE_DICT_TYPE,
    *,
    checkpoint_id: str | os.PathLike | None = None,
    storage_writer: StorageWriter | None = None,
    planner: SavePlanner | None = None,
    process_group: dist.ProcessGroup | None = None,
    async_checkpointer_type: AsyncCheckpointerType = AsyncCheckpointerType.THREAD,
    async_stager: Any = None,
    no_dist: bool = False,
    use_collectives: bool = True,
) -> Future | AsyncSaveResponse:
    """PyTorch's ``async_save`` with our atomic :class:`FileSystemWriter` by default.

    A save that fails fails as :func:`save` does: its staging directory is removed on
    every rank and the future's ``result()`` raises the same :class:`CheckpointError`
    (with ``AsyncCheckpointerType.THREAD``; a ``PROCESS`` save stages in its own process).

    Example:
        >>> import tensorplay as tp
        >>> import tensorplay.distributed.checkpoint as dcp
        >>> future = dcp.async_save({"weight": tp.ones(3)}, checkpoint_id="ckpt_async")
        >>> future.result()  # training can go on until here
        Metadata(...)
    """
    writer = _writer(checkpoint_id, storage_writer)
    response = _torch_saver.async_save(state_dict, checkpoint_id=checkpoint_id, storage_writer=writer,
                                       planner=planner, process_group=process_group,
                                       async_checkpointer_type=async_checkpointer_type, async_stager=async_stager,
                                       no_dist=no_dist, use_collectives=use_collectives)
    if isinstance(response, AsyncSaveResponse):
        upload = _settled_as_save(response.upload_completion, writer, checkpoint_id, process_group)
        return AsyncSaveResponse(staging_completion=response.staging_completion, upload_completion=upload)
    return _settled_as_save(response, writer, checkpoint_id, process_group)


def save_state_dict(
    state_dict: STATE_DICT_TYPE,
    storage_writer: StorageWriter,
    process_group: dist.ProcessGroup | None = None,
    coordinator_rank: int = 0,
    no_dist: bool = False,
    planner: SavePlanner | None = None,
) -> Metadata:
    """Deprecated in PyTorch (use :func:`save`); kept for code that still calls it.

    Example:
        >>> import tensorplay as tp
        >>> import tensorplay.distributed.checkpoint as dcp
        >>> dcp.save_state_dict({"weight": tp.ones(3)}, dcp.FileSystemWriter("ckpt"))  # deprecated: use save()
        Metadata(...)
    """
    storage_writer.reset()
    return _torch_saver._save_state_dict(state_dict, storage_writer, process_group, coordinator_rank, no_dist,
                                         planner)


def __getattr__(name: str) -> object:
    """Any other name of PyTorch's ``torch.distributed.checkpoint.state_dict_saver`` (the same object)."""
    import torch.distributed.checkpoint.state_dict_saver as torch_module

    try:
        return getattr(torch_module, name)
    except AttributeError:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None
