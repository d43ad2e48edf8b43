"""Consistency modes: one policy each over the same shard store (docs/semantics.md, "Modes")."""

from pserver.modes.async_ import AsyncPolicy
from pserver.modes.backup import BackupPolicy
from pserver.modes.base import Outcome, Policy
from pserver.modes.ssp import SSPPolicy
from pserver.modes.sync import SyncPolicy

POLICIES = {p.name: p for p in (SyncPolicy, BackupPolicy, AsyncPolicy, SSPPolicy)}


def make_policy(store, cfg, members) -> Policy:
    """The policy for cfg.mode (ServerConfig has already checked the name), over the shard's
    store and its workers' membership (pserver.server.membership)."""
    return POLICIES[cfg.mode](store, cfg, members)


__all__ = ["Outcome", "Policy", "POLICIES", "make_policy",
           "SyncPolicy", "BackupPolicy", "AsyncPolicy", "SSPPolicy"]
