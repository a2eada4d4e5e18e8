"""The errors a checkpoint load or save raises: what is wrong, in which file, on which rank."""

from __future__ import annotations

import pickle

from torch.distributed.checkpoint.api import CheckpointException

__all__ = ["CheckpointError", "CorruptCheckpointError", "UnsafeCheckpointError"]


class CorruptCheckpointError(ValueError):
    """A checkpoint file is missing, truncated or does not match its recorded checksum.

    Example:
        >>> from tensorplay.distributed.checkpoint import CorruptCheckpointError
        >>> isinstance(CorruptCheckpointError("ckpt/__0_0.distcp: crc32 mismatch"), ValueError)
        True
    """


class UnsafeCheckpointError(pickle.UnpicklingError):
    """A checkpoint asks to build an object outside the allow-list (loading it could run code), or to read
    something that is not a regular file inside its directory (a path outside it, a device, a FIFO).

    Example:
        >>> import pickle
        >>> from tensorplay.distributed.checkpoint import UnsafeCheckpointError
        >>> issubclass(UnsafeCheckpointError, pickle.UnpicklingError)   # caught where pickle errors are
        True
    """


class CheckpointError(CheckpointException, RuntimeError):
    """A save or load failed on one or more ranks; raised on every rank.

    ``failures`` maps each failing rank to ``(exception, traceback)`` as in PyTorch's
    ``CheckpointException`` (which this subclasses, so code catching that still works);
    unlike it, this is an ``Exception`` and its message names each rank's error in one line.

    Example:
        >>> from torch.distributed.checkpoint.api import CheckpointException
        >>> from tensorplay.distributed.checkpoint import CheckpointError
        >>> issubclass(CheckpointError, CheckpointException)   # code catching PyTorch's exception still works
        True
    """

    def __init__(self, what: str, failures: dict) -> None:
        super().__init__(what, failures)
        self.what = what

    def __str__(self) -> str:
        lines = [self.what]
        for rank, (exc, _trace) in sorted(self.failures.items()):
            lines.append(f"  rank {rank}: {type(exc).__name__}: {exc}")
        return "\n".join(lines)

    @classmethod
    def wrap(cls, error: CheckpointException, what: str, local: tuple[int, BaseException | None] = (0, None)
             ) -> CheckpointError:
        """``error`` as ours; ``local``: this rank and why it refused the metadata, if it did."""
        ranks = ", ".join(str(r) for r in sorted(error.failures))
        failures = {rank: (_metadata_cause(exc, local[1] if rank == local[0] else None), trace)
                    for rank, (exc, trace) in error.failures.items()}
        return cls(f"{what} failed on rank(s) {ranks}", failures)


_METADATA_FAILED = "metadata is None; global metadata read failed: "


def _metadata_cause(exc: BaseException, known: BaseException | None) -> BaseException:
    """PyTorch's "metadata is None" AssertionError replaced by why the metadata was refused."""
    if not (isinstance(exc, AssertionError) and str(exc).startswith(_METADATA_FAILED)):
        return exc
    if known is not None:
        return known
    return CorruptCheckpointError(str(exc)[len(_METADATA_FAILED):].split("; rank local metadata read failed")[0])
