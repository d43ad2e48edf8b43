"""The one way pserver puts a file (or a directory of files) on disk: written whole under a
temporary name beside its final one, fsynced, renamed over the final name, then the directory
fsynced. A crash at any moment leaves either the previous file or the new one under the final
name, never half of one; a write that fails removes its temporary file, and `remove_stale`
removes what a killed writer left.

Checkpoints (pserver.persist.checkpoint), model files and their directories
(pserver.persist.model_file) and a checkpoint directory's RUN file all go through here."""

from __future__ import annotations

import contextlib
import glob
import os
import shutil
from typing import Callable, Iterator


@contextlib.contextmanager
def synced(path: str) -> Iterator:
    """`path` opened for writing (binary), flushed and fsynced when the block ends."""
    with open(path, "wb") as f:
        yield f
        f.flush()
        os.fsync(f.fileno())


def replace(path: str, write: Callable[[str], None], tmp: str) -> None:
    """write(tmp) (a file or a directory, each file of it fsynced: `synced`), then tmp renamed
    over `path` and its directory fsynced. A directory at `path` (an older sparse model) is moved
    aside first and removed after; a file at `path` that a directory replaces is removed. Any
    failure (disk full, a read-only or missing directory) removes tmp and raises."""
    aside = f"{path}.old-{os.getpid()}"
    try:
        write(tmp)
        if os.path.isdir(path) and not os.path.islink(path):
            os.rename(path, aside)
        elif os.path.isdir(tmp) and os.path.lexists(path):
            os.remove(path)             # a dense model file replaced by a sparse model's directory
        os.replace(tmp, path)
        fsync_dir(os.path.dirname(os.path.abspath(path)))
    except BaseException:
        remove(tmp)
        raise
    remove(aside)


def fsync_dir(directory: str) -> None:
    """A rename or a link in `directory` made durable."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def remove_quietly(path: str) -> None:
    try:
        os.remove(path)
    except OSError:
        pass              # already gone, or the directory itself went away


def remove(path: str) -> None:
    """A file or a whole directory, if there."""
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path, ignore_errors=True)
    elif os.path.lexists(path):
        os.remove(path)


def remove_stale(path: str) -> list[str]:
    """What writers of `path` that were killed left beside it (PATH.tmp-PID, PATH.old-PID of a
    process that is gone), removed; their paths."""
    removed = []
    for leftover in glob.glob(glob.escape(path) + ".tmp-*") + glob.glob(glob.escape(path) + ".old-*"):
        pid = leftover.rsplit("-", 1)[1]
        if pid.isdigit() and not _alive(int(pid)):
            remove(leftover)
            removed.append(leftover)
    return removed


def _alive(pid: int) -> bool:
    if pid == os.getpid():
        return False                # ours, from an earlier call that failed: not in use
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
