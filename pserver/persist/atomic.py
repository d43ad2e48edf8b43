"""The one way pserver puts a file (or a directory of files) on disk: written whole under a
temporary name beside its final one, fsynced, renamed over the final name, then the directory
fsynced. A crash at any moment leaves either the previous file or the new one under the final
name, never half of one; a write that fails removes its temporary file, and `sweep` (or
`remove_stale`, for one path) removes what a killed writer left.

The temporary names, of every writer (`temp_path`):

    NAME.PID.tmp        NAME being written by process PID (NAME.PID.HEX8.tmp: one of several
                        writers of NAME in that process)
    NAME.PID.old        a directory at NAME moved aside while its replacement is renamed in

A leftover is removed once its process is gone. Names older versions wrote are recognised
too: NAME.tmp-PID and NAME.old-PID (model directories before this convention).

Checkpoints (pserver.persist.checkpoint), model files and their directories
(pserver.persist.model_file) and a checkpoint directory's RUN file all go through here."""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import uuid
from typing import Callable, Iterator

# What a writer leaves beside NAME: this convention's NAME.PID[.HEX8].tmp and NAME.PID.old, and
# the older NAME.tmp-PID and NAME.old-PID. Searched for from the left, so NAME is what precedes it.
LEFTOVER = re.compile(r"\.(?:(?P<pid>\d+)(?:\.[0-9a-f]{8})?\.(?:tmp|old)|(?:tmp|old)-(?P<older>\d+))$")


def temp_path(path: str, unique: bool = False) -> str:
    """Where this process writes `path` before renaming it: PATH.PID.tmp; `unique`: one of several
    writers of path in this process (PATH.PID.HEX8.tmp)."""
    tag = f".{uuid.uuid4().hex[:8]}" if unique else ""
    return f"{path}.{os.getpid()}{tag}.tmp"


@contextlib.contextmanager
def synced(path: str) -> Iterator:
    """`path` opened for writing (binary), flushed and fsynced when the block ends."""
    with open(path, "wb") as f:
        yield f
        f.flush()
        os.fsync(f.fileno())


def replace(path: str, write: Callable[[str], None]) -> None:
    """write(tmp) (tmp: `temp_path`; a file or a directory, each file of it fsynced: `synced`),
    then tmp renamed over `path` and its directory fsynced. A directory at `path` (an older sparse
    model) is moved aside first (PATH.PID.old) and removed after; a file at `path` that a directory
    replaces is removed. Any failure (disk full, a read-only or missing directory) removes tmp and
    raises."""
    tmp, aside = temp_path(path), f"{path}.{os.getpid()}.old"
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
    """What writers of `path` that were killed left beside it, removed (`sweep`); their paths."""
    name = os.path.basename(path)
    return sweep(os.path.dirname(path) or ".", lambda final: final == name)


def sweep(directory: str, final: Callable[[str], bool]) -> list[str]:
    """What writers that were killed left in `directory` (a temporary file or directory, or one
    moved aside: LEFTOVER, of a process that is gone) beside a name that `final` accepts,
    removed; their paths."""
    removed = []
    try:
        names = os.listdir(directory)
    except (FileNotFoundError, NotADirectoryError):
        return removed
    for name in names:
        m = LEFTOVER.search(name)
        if m and final(name[:m.start()]) and not _alive(int(m.group("pid") or m.group("older"))):
            try:
                remove(os.path.join(directory, name))
            except FileNotFoundError:
                continue                # another sweep of this directory took it first
            removed.append(os.path.join(directory, name))
    return removed


def _alive(pid: int) -> bool:
    if pid == os.getpid():
        return False                # ours, from an earlier call that failed: not in use
    try:
        os.kill(pid, 0)
    except (ProcessLookupError, OverflowError):      # gone, or no pid at all (a name's digits)
        return False
    except PermissionError:
        return True
    return True
