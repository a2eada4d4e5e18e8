"""Publish a checkpoint directory atomically: write beside it, fsync, rename into place.

[Note: atomic multi-rank save]
Every rank writes its files into one staging directory, a hidden sibling of the
target (``.<name>.saving-<id>``, the id chosen by the coordinator in the global
plan, so every rank agrees on it) and fsyncs them. DCP's write step then gathers
every rank's results on the coordinator, which is the barrier: only after all
ranks' files are durable does the coordinator write ``.metadata`` and the
manifest, fsync the directory, and rename it onto the target. The target is
therefore either the previous checkpoint or the complete new one; a save that
fails removes its staging directory on every rank, and a save killed at any point
leaves the previous checkpoint untouched (and a stale staging directory, removed
when the next save of that target starts, or by a load once the process that
made it is gone: the directory's name carries the coordinator's pid and host).

Replacing an existing checkpoint uses Linux ``renameat2(RENAME_EXCHANGE)``, one
atomic swap; where that is unavailable, two renames (target -> old, staging ->
target), so a crash between them leaves the previous checkpoint under
``.<name>.old-<id>`` rather than at the target. Either way the replaced
checkpoint ends up as ``.<name>.old-<id>`` and is deleted on a background
thread, off the save's critical path. Before writing, each rank lets the kernel
drop the page cache of the files it is replacing (:func:`drop_cached`), so the
new files reuse that memory as an in-place overwrite would.
"""

from __future__ import annotations

import ctypes
import os
import shutil
import socket
import threading
import uuid
from pathlib import Path

__all__ = ["check_replaceable", "drop_cached", "fsync_dir", "new_staging_dir", "publish", "remove_stale",
           "remove_staging"]

_RENAME_EXCHANGE = 2
_AT_FDCWD = -100


#: File names a checkpoint directory is made of (DCP's and our manifest); anything else is the user's.
_CHECKPOINT_SUFFIXES = (".distcp", ".metadata", ".metadata.tmp", ".tensorplay_manifest.json")


def check_replaceable(target: Path) -> None:
    """Refuse a target directory holding anything but checkpoint files: publishing replaces it whole."""
    if not target.exists():
        return
    if not target.is_dir():
        raise FileExistsError(f"checkpoint path {target} exists and is not a directory; choose another path")
    foreign = sorted(p.name for p in target.iterdir() if p.is_dir() or not p.name.endswith(_CHECKPOINT_SUFFIXES))
    if foreign:
        raise FileExistsError(f"checkpoint path {target} holds {foreign[:5]}, which are not checkpoint files; a save "
                              f"replaces the whole directory, so give each checkpoint a directory of its own")


def drop_cached(target: Path, prefix: str) -> None:
    """Let the kernel drop the cached pages of the checkpoint this rank's files (``prefix*``) will replace.

    PyTorch's writer overwrites in place, so the old files' page cache is freed as
    the new ones are written. Ours keeps the previous checkpoint whole until the new
    one is published, so without this the new files need as much fresh page cache
    again, and on this VM fresh pages stall writes (0.4-0.7 s per 200 MB at times).
    The files stay on disk, intact: only their clean cached copies go.
    """
    if not hasattr(os, "posix_fadvise") or not target.is_dir():
        return
    for old in target.glob(f"{prefix}*.distcp"):
        try:
            fd = os.open(old, os.O_RDONLY)
        except OSError:
            continue
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def new_staging_dir(target: Path) -> Path:
    """A fresh staging directory name that says which process (the coordinator) owns it."""
    return target.parent / f".{target.name}.saving-{uuid.uuid4().hex[:12]}-{os.getpid()}-{socket.gethostname()}"


def remove_staging(staging: Path | None) -> None:
    """Remove a failed save's staging directory (every rank may; what is gone is skipped)."""
    if staging is not None:
        shutil.rmtree(staging, ignore_errors=True)


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    except OSError:  # some filesystems refuse fsync on a directory; the data files are synced
        pass
    finally:
        os.close(fd)


def _exchange(a: Path, b: Path) -> bool:
    """Swap two paths atomically; False when the platform cannot."""
    try:
        # The symbols already loaded into this process (libc among them): ctypes.util.find_library would
        # start a subprocess (ldconfig) on every save.
        libc = ctypes.CDLL(None, use_errno=True)
    except OSError:
        return False
    renameat2 = getattr(libc, "renameat2", None)
    if renameat2 is None:
        return False
    rc = renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE)
    return rc == 0


def publish(staging: Path, target: Path) -> None:
    """Move the complete ``staging`` directory onto ``target``, replacing a previous checkpoint there."""
    fsync_dir(staging)
    check_replaceable(target)
    if not target.exists():
        os.rename(staging, target)
    else:
        old = target.parent / f".{target.name}.old-{uuid.uuid4().hex[:12]}"
        if _exchange(staging, target):
            os.rename(staging, old)  # staging now holds the previous checkpoint
        else:
            os.rename(target, old)
            os.rename(staging, target)
        _remove_in_background(old)
    fsync_dir(target.parent)


def _remove_in_background(old: Path) -> None:
    """Delete a replaced checkpoint off the caller's path (freeing a large tree's pages takes a while).

    The new checkpoint is already in place; if the process exits first, the next
    save of the same target removes the leftover (:func:`remove_stale`, called before it stages).
    """
    threading.Thread(target=shutil.rmtree, args=(old,), kwargs={"ignore_errors": True},
                     name="tensorplay-checkpoint-cleanup", daemon=True).start()


def remove_stale(target: Path, live_saves: bool = False) -> None:
    """Delete staging directories that killed saves of ``target`` left behind, and replaced checkpoints
    that a background removal did not finish.

    ``live_saves``: another process may be saving ``target`` now (a load calls this), so only staging
    directories whose owner is known dead go: made on this host by a process that no longer runs.
    """
    for stale in target.parent.glob(f".{target.name}.old-*"):
        shutil.rmtree(stale, ignore_errors=True)
    for stale in target.parent.glob(f".{target.name}.saving-*"):
        if not live_saves or _owner_dead(stale.name.split(".saving-", 1)[1]):
            shutil.rmtree(stale, ignore_errors=True)


def _owner_dead(suffix: str) -> bool:
    """Whether the process named in a staging suffix (``<id>-<pid>-<host>``) is gone from this host."""
    parts = suffix.split("-", 2)
    if len(parts) != 3 or not parts[1].isdigit() or parts[2] != socket.gethostname():
        return False
    try:
        os.kill(int(parts[1]), 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    return False
