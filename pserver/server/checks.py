"""What a request must be before a shard acts on it: pure checks of the request against the
shard's place (ServerConfig's shard and num_shards) and its layout, each raising the pserver
error that names the field and the value (docs/semantics.md, "Errors").

`Shard` calls them in a fixed order, everything before anything changes: a refused request
leaves the shard as it was. None of them takes a lock or reads the shard's state beyond what
it is given.
"""

from __future__ import annotations

import numpy as np

from pserver import sparse
from pserver.config import ServerConfig
from pserver.errors import ConfigError, FailedPrecondition, InvalidArgument, OverBudget
from pserver.models.layout import Layout
from pserver.server.store import first_nonfinite
from pserver.sparse import RowGrads
from pserver.wire.codec import DTYPE_NAME, PROTOCOL_VERSION
from pserver.wire.frames import MAX_METRIC_SUMS

MAX_PARAMS = 1 << 33                  # 8G elements (32 GB) per model: a sanity bound on declared sizes
MAX_TABLES = 1024                     # sparse tables per model
MAX_ROW_DIM = 1 << 16                 # values per sparse row


def check_protocol(protocol_version: int) -> None:
    if protocol_version != PROTOCOL_VERSION:
        raise FailedPrecondition(
            f"protocol_version: the worker speaks wire protocol {protocol_version} and this "
            f"shard speaks {PROTOCOL_VERSION}; run the same pserver release on both sides")


def check_shard(cfg: ServerConfig, shard: int, num_shards: int | None = None) -> None:
    """The request is for this shard (and, when it says so, a job of this many shards)."""
    if shard != cfg.shard or (num_shards is not None and num_shards != cfg.num_shards):
        told = f"shard {shard}" + (f" of {num_shards}" if num_shards is not None else "")
        raise FailedPrecondition(f"shard: the request is for {told} but this is shard "
                                 f"{cfg.shard} of {cfg.num_shards}")


def checked_total(layout: Layout) -> int:
    """P of a layout a worker declared, checked before anything is allocated. Python
    integers, capped: numpy's int64 product wraps around, which would let a huge layout
    pass as a small (or empty) one."""
    if any(d < 0 for t in layout.tensors for d in t.shape):
        raise InvalidArgument("layout: a tensor has a negative dimension")
    total = 0
    for t in layout.tensors:
        size = 1
        for d in t.shape:
            size = min(size * d, MAX_PARAMS + 1)
        total = min(total + size, MAX_PARAMS + 1)
    if not 1 <= total <= MAX_PARAMS:
        told = f"more than {MAX_PARAMS}" if total > MAX_PARAMS else str(total)
        raise InvalidArgument(f"layout: {len(layout.tensors)} tensors, {told} elements; "
                              f"need 1 to {MAX_PARAMS} elements")
    return total


def checked_tables(tables) -> None:
    """The sparse tables a worker declared, checked before anything is allocated."""
    if len(tables) > MAX_TABLES:
        raise InvalidArgument(f"tables: {len(tables)} sparse tables; at most {MAX_TABLES}")
    names = [t.name for t in tables]
    for t in tables:
        if not t.name or names.count(t.name) > 1:
            raise InvalidArgument(f"tables: sparse table names must be unique and non-empty, got {names}")
        if not 1 <= t.dim <= MAX_ROW_DIM:
            raise InvalidArgument(f"tables: table '{t.name}' has dim {t.dim}; need 1 to {MAX_ROW_DIM}")
        try:
            t.check()
        except (ValueError, ConfigError) as e:
            raise InvalidArgument(f"tables: table '{t.name}': {e}") from None


def checked_registration(num_workers: int, layout: Layout) -> int:
    """A Register's own fields, in the order they are refused; returns the layout's P."""
    if num_workers < 1:
        raise InvalidArgument(f"num_workers: must be >= 1, got {num_workers}")
    total = checked_total(layout)
    checked_tables(layout.tables)
    try:
        pairs = layout.statistics_pairs()
    except ValueError as e:
        raise InvalidArgument(f"layout: {e}") from None
    bad = next((m for *_, m in pairs if not 0 <= m <= 1), None)
    if bad is not None:
        raise InvalidArgument(f"layout: a moving statistic's momentum must be in [0, 1], got {bad}")
    return total


def check_statistics(expected: int, values) -> None:
    """A push's statistics carried apart (PushRequest.statistics): one finite value for each mean
    element another shard holds whose variance this one does, else refused before anything changes."""
    if len(values) != expected:
        raise InvalidArgument(f"statistics: {len(values)} values for the {expected} moving-mean element(s) "
                              "this shard's moving variance needs from another shard (away_means)")
    if expected and not np.all(np.isfinite(values)):
        raise InvalidArgument("statistics: a value is not finite")


def check_trained(trained: tuple, num_samples: int) -> None:
    """What a leased push says its batch's step measured (loss x samples, samples classed right)
    is summed into every worker's History: a count of right samples outside [0, num_samples] (NaN
    too) is no count, and the push is refused before anything changes. The loss is taken as it
    comes, NaN or infinite included: a run whose loss diverged shows it, as Keras does."""
    correct, sums = trained[1], trained[2] if len(trained) > 2 else ()
    if len(sums) > MAX_METRIC_SUMS:
        raise InvalidArgument(f"lease_metric_sums: {len(sums)} values; at most {MAX_METRIC_SUMS} (the "
                              f"compiled metrics' state)")
    if not 0 <= correct <= num_samples:
        raise InvalidArgument(f"lease_correct: {correct} samples classed right in a batch of {num_samples}; "
                              f"send how many of the batch's samples the model classed right (0 to "
                              f"num_samples)")


def check_samples(num_samples: int) -> None:
    """A push's gradient is the mean over the samples it carries, and a sync or backup step
    weighs each push by them (docs/semantics.md): a gradient of no samples has no weight, and
    a negative count is no count. Every push carries a gradient (its range's values); one of 0
    samples is an empty contribution (a worker with no chunk of the data left this epoch): it counts
    toward its step and weighs nothing."""
    if num_samples < 0:
        raise InvalidArgument(f"num_samples: {num_samples} for a push; a gradient is the mean over its "
                              f"batch and a sync step weighs it by the batch's samples, so send the "
                              f"batch's size (0 for an empty contribution: a worker with no chunk left)")


def check_payload(cfg: ServerConfig, size: int, num_elements: int, dtype: str) -> None:
    """A dense payload (an Init's values, a push's gradient) is the shard's range, in float32."""
    if dtype != DTYPE_NAME:
        raise InvalidArgument(f"dtype: '{dtype}' is not supported; send '{DTYPE_NAME}'")
    if num_elements != size:
        raise InvalidArgument(f"num_elements: {num_elements} does not match shard "
                              f"{cfg.shard}'s range of {size} elements")


def only_push_carries(sparse_parts, compression: str, push: bool) -> None:
    """Sparse rows and a compressed payload come with a Push, never with an Init."""
    if (sparse_parts or compression) and not push:
        raise InvalidArgument("sparse, compression: only a Push carries sparse rows "
                              "or a compressed payload")


def table(tables: dict, name: str) -> sparse.SparseTable:
    got = tables.get(name)
    if got is None:
        have = ", ".join(tables) or "none"
        raise InvalidArgument(f"table: the model has no sparse table '{name}' (its tables: {have})")
    return got


def row_buffers(tables: dict, parts: list[tuple[str, int]], limit: int, flag: str) -> list[RowGrads]:
    """Shard-owned arrays for a push's sparse parts [(table, number of ids)], checked before a
    byte of them is received: known tables, counts not negative, and together within one push's
    in-flight bytes (`limit`, set by `flag`)."""
    out, nbytes = [], 0
    for name, n in parts:
        t = table(tables, name)
        if n < 0:
            raise InvalidArgument(f"num_ids: must be >= 0, got {n} for table '{name}'")
        nbytes += n * (8 + 4 * t.config.dim)
        if nbytes > limit:
            raise OverBudget(f"sparse: the push's rows need more than {nbytes >> 20} MiB and "
                             f"one push may carry {limit >> 20} MiB ({flag})")
        out.append(RowGrads(name, np.empty(n, np.uint64), np.empty((n, t.config.dim), np.float32)))
    return out


def check_ids(cfg: ServerConfig, ids: np.ndarray, what: str) -> None:
    """Every id must live on this shard: a client that hashed wrongly would otherwise
    create rows that no other worker ever reads."""
    i = sparse.first_foreign(ids, cfg.num_shards, cfg.shard)
    if i >= 0:
        owner = int(sparse.shard_of(ids[i:i + 1], cfg.num_shards)[0])
        raise InvalidArgument(f"{what}: id {ids[i]} (element {i}) lives on shard {owner}, not on "
                              f"shard {cfg.shard} (pserver.sparse.shard_of)")


def check_rows(cfg: ServerConfig, rows: list[RowGrads]) -> None:
    """What a sparse push must be before anything is applied: ids unique, on this shard,
    one part per table, gradients finite."""
    seen = set()
    for p in rows:
        if p.table in seen:
            raise InvalidArgument(f"sparse: table '{p.table}' appears twice in one push; send "
                                  f"each table's rows once")
        seen.add(p.table)
        check_ids(cfg, p.ids, f"sparse '{p.table}'")
        if sparse.first_repeat(p.ids) >= 0:
            raise InvalidArgument(f"sparse '{p.table}': ids repeat within the push; sum the "
                                  f"gradients of each id and send it once")
        bad = first_nonfinite(p.grads.reshape(-1))
        if bad >= 0:
            row, col = divmod(bad, p.grads.shape[1])
            raise InvalidArgument(f"sparse '{p.table}': the gradient of id {p.ids[row]} holds a "
                                  f"non-finite value ({p.grads[row, col]}) at column {col}")
