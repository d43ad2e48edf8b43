"""The worker's session file: the credentials its Register got, kept so that a restarted worker
takes its rank back at once instead of waiting --step-timeout for its old session to expire.

One file per (shards' addresses, rank), of mode 0600 in a directory of mode 0700, by default
`$XDG_STATE_HOME/pserver/sessions/` (`~/.local/state/pserver/sessions/`). It holds the rank, the
addresses, and per shard the shard process's run id (`instance`) and the credential. As ssh does
with its keys, a file or directory that another user owns, or that others may read or write, is
refused (one line naming it, exit 2): whoever can read the file can act as the worker, which is
also true of whoever holds the token (and, without TLS, of whoever watches the network).

The worker writes the file after every Register and removes it when it leaves (finished, or
stopped by a signal); only a worker that died (kill -9, a crash, a lost machine) leaves it behind.

A `--rank auto` worker does not know its rank before shard 0 assigns it, so its file is a slot,
`auto{n}-KEY.json`: the worker takes the first slot of the cluster that no live process holds
(each holds its slot's lock, flock, for as long as it runs; the system drops a dead process's
lock) and presents the credential the slot kept, with which shard 0 gives it back the rank of the
worker that died holding the slot. Two auto workers on one machine take two slots, so a restart
never takes over a live worker's rank.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
from typing import Sequence

from pserver.errors import ConfigError
from pserver.wire.security import check_private, state_dir

NONE = "none"                    # --session-dir none: keep no file (a restart waits for expiry)
MAX_BYTES = 1 << 16              # a session file is a few hundred bytes
AUTO_SLOTS = 64                  # --rank auto workers of one cluster on one machine


def default_dir() -> str:
    return os.path.join(state_dir(), "sessions")


def path_for(directory: str, ps: Sequence[str], rank: int) -> str:
    """The file of this rank of the cluster whose shards are `ps` (in shard order)."""
    key = hashlib.sha256("\n".join([*ps, f"rank={rank}"]).encode()).hexdigest()[:16]
    return os.path.join(directory, f"rank{rank}-{key}.json")


def auto_path_for(directory: str, ps: Sequence[str], slot: int) -> str:
    key = hashlib.sha256("\n".join([*ps, "rank=auto"]).encode()).hexdigest()[:16]
    return os.path.join(directory, f"auto{slot}-{key}.json")


class SessionFile:
    """The credentials of one worker (rank) of one cluster (ps), on disk."""

    def __init__(self, directory: str | None, ps: Sequence[str], rank: int) -> None:
        self.directory = default_dir() if directory is None else directory
        self.ps, self.rank = list(ps), rank
        self.path = None if self.directory == NONE else path_for(self.directory, ps, rank)
        self.warned = False
        self.lock_fd: int | None = None     # an auto slot's lock, held while this process runs

    @classmethod
    def auto_slot(cls, directory: str | None, ps: Sequence[str]) -> SessionFile:
        """--rank auto: the first slot file no live process holds, locked for this process's
        life; its rank is the one the slot kept (-1: none), set to the assigned one later."""
        self = cls(directory, ps, -1)
        if self.path is None:
            return self
        try:
            os.makedirs(self.directory, mode=0o700, exist_ok=True)
            check_private(self.directory, 0o700, "directory", "--session-dir")   # refused: raises
            for slot in range(AUTO_SLOTS):
                path = auto_path_for(self.directory, ps, slot)
                fd = os.open(path + ".lock", os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except OSError:
                    os.close(fd)
                    continue                # a live worker's slot
                self.path, self.lock_fd = path, fd
                self.rank = self._kept_rank()
                return self
        except OSError as e:                # a full or read-only disk costs the file, not the run
            print(f"--session-dir: cannot keep this --rank auto worker's session in {self.directory} "
                  f"({e.strerror or e}); a restart of it gets a new rank", flush=True)
        self.path = None                    # every slot live, or no directory: keep no file
        return self

    def _kept_rank(self) -> int:
        if not os.path.lexists(self.path):
            return -1
        check_private(self.path, 0o600, "file", "--session-dir")
        try:
            with open(self.path, "rb") as f:
                rank = json.loads(f.read(MAX_BYTES)).get("rank")
            return rank if isinstance(rank, int) and rank > 0 else -1
        except (OSError, ValueError, AttributeError):
            return -1

    def load(self) -> dict[str, str]:
        """address -> the credential kept for it ({} when there is no file). A file that is
        unreadable JSON or for another rank or cluster is ignored (it only costs the wait)."""
        if self.path is None:
            return {}
        if os.path.isdir(self.directory):
            check_private(self.directory, 0o700, "directory", "--session-dir")
        if not os.path.lexists(self.path):
            return {}
        check_private(self.path, 0o600, "file", "--session-dir")
        try:
            with open(self.path, "rb") as f:
                data = json.loads(f.read(MAX_BYTES))
            if data.get("rank") != self.rank or data.get("ps") != self.ps:
                return {}
            return {s["address"]: s["session"] for s in data["shards"]
                    if isinstance(s.get("address"), str) and isinstance(s.get("session"), str)}
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            return {}

    def save(self, shards: Sequence[tuple[str, str, str]]) -> None:
        """Write [(address, instance, session)] atomically: a new file of mode 0600, renamed
        over the old one, in a directory made 0700. A directory that is not private is refused;
        a disk that is full or read-only costs only the file (one line, training goes on: a
        restart then waits for the old session to expire)."""
        if self.path is None:
            return
        try:
            os.makedirs(self.directory, mode=0o700, exist_ok=True)
            check_private(self.directory, 0o700, "directory", "--session-dir")   # refused: raises
            body = json.dumps({"rank": self.rank, "ps": self.ps,
                               "shards": [dict(address=a, instance=i, session=s) for a, i, s in shards]})
            tmp = f"{self.path}.{os.getpid()}.tmp"
            try:
                fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
                with os.fdopen(fd, "w") as f:
                    f.write(body)
                os.replace(tmp, self.path)
            finally:
                if os.path.lexists(tmp):
                    os.unlink(tmp)
        except OSError as e:
            if not self.warned:
                self.warned = True
                print(f"--session-dir: cannot keep this worker's session in {self.path} "
                      f"({e.strerror or e}); a restart of it waits for its old session to expire",
                      flush=True)

    def remove(self, mine: dict[str, str]) -> None:
        """Remove the file if it still holds `mine` (address -> credential): a process whose
        rank was taken over must not remove the file of the process that took it."""
        if self.path is None:
            return
        try:
            if self.load() == mine:
                os.unlink(self.path)
        except (OSError, ConfigError):
            pass
