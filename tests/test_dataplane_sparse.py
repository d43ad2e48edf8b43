"""Sparse rows over the same-host data plane (pserver/server/dataplane.py): PULL_ROWS, PUSH_ROWS and
the per-connection rows buffer, against live in-process shards, with real clients and with
hostile ones that speak the socket protocol by hand.

The rows buffer changes size with the requests, but whatever a client does with it the
shard's memory stays the shard's: it maps one sealed buffer per connection within the
bound, copies ids and gradients out before it checks them, and a refused request changes
no table.
"""

from __future__ import annotations

import os
import socket

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pserver import sparse
from pserver.errors import InvalidArgument
from pserver.models.layout import Layout
from pserver.sparse import TableConfig, TableLookup
from pserver.wire import frames
from pserver.worker.client import PSClient

DIM = 4
TABLES = [TableConfig("emb", DIM, optimizer="sgd", lr=0.5, init_scale=0.1, seed=7),
          TableConfig("wide", 1, optimizer="adagrad", lr=0.1, seed=7)]
LAYOUT = Layout.of([("b", (3,))], TABLES)


def cluster(shard_server, num_shards=1, **cfg):
    return [shard_server(shard=j, num_shards=num_shards, optimizer="sgd", lr=1.0, **cfg)
            for j in range(num_shards)]


def client(servers, plane="auto", rank=0, num_workers=1) -> PSClient:
    c = PSClient([a for a, _ in servers], rank=rank, num_workers=num_workers, rpc_deadline=20,
                 data_plane=plane)
    c.connect(5)
    c.register(LAYOUT)
    if rank == 0:
        c.init(np.zeros(LAYOUT.total, np.float32))
    c.pull(np.empty(LAYOUT.total, np.float32))
    assert all((s.fast is not None) == (plane == "auto") for s in c.shards)
    return c


def lookups(ids, grads_seed=None) -> list[TableLookup]:
    """One lookup per table over the same ids; gradients drawn from grads_seed."""
    out = [TableLookup.of(np.asarray(ids, np.int64), t.dim) for t in TABLES]
    if grads_seed is not None:
        rng = np.random.default_rng(grads_seed)
        for lk in out:
            lk.grads[:] = rng.standard_normal(lk.grads.shape, dtype=np.float32)
    return out


def pulled(c: PSClient, ids) -> list[np.ndarray]:
    lks = lookups(ids)
    c.pull_rows(lks, [t.name for t in TABLES])
    return [lk.rows[lk.inverse] for lk in lks]


def push(c: PSClient, lks: list[TableLookup]):
    out = c.push(np.zeros(LAYOUT.total, np.float32), 1, lookups=lks, tables=[t.name for t in TABLES])
    c.pull(np.empty(LAYOUT.total, np.float32))
    return out


def table_state(servers) -> list[dict]:
    return [{n: t.state().arrays() for n, t in shard.store.tables.items()} for _, shard in servers]


def assert_same_state(a: list[dict], b: list[dict]) -> None:
    assert len(a) == len(b)
    for sa, sb in zip(a, b):
        assert sa.keys() == sb.keys()
        for name in sa:
            assert sa[name].keys() == sb[name].keys()
            for k in sa[name]:
                np.testing.assert_array_equal(sa[name][k], sb[name][k], err_msg=f"{name} {k}")


def rows_mappings(shard) -> int:
    """Mappings in this process of the rows buffers of one in-process shard (its own, and
    those of its clients here)."""
    with open("/proc/self/maps") as f:
        return sum(f"memfd:pserver-rows-{shard.dataplane.tag} " in line for line in f)


def ids_of_shard(j: int, num_shards: int, n: int) -> np.ndarray:
    cand = np.arange(1, 50 * n + 50, dtype=np.uint64)
    return cand[sparse.shard_of(cand, num_shards) == j][:n]


# --- the layout both sides compute --------------------------------------------------------

@settings(max_examples=200, deadline=None)
@given(parts=st.lists(st.tuples(st.integers(0, 5000), st.integers(1, 33)), max_size=8))
def test_row_layout_places_each_part_aligned_and_apart(parts):
    slots, end = frames.row_layout(parts)
    spans = []
    for (n, dim), (ids_at, rows_at) in zip(parts, slots):
        assert ids_at % 8 == 0 and rows_at == ids_at + 8 * n
        spans += [(ids_at, rows_at), (rows_at, rows_at + 4 * n * dim)]
    spans.sort()
    assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:]))            # no overlap
    assert end == sum(8 * n + -(-4 * n * dim // 8) * 8 for n, dim in parts)
    assert frames.fits(parts) == (end <= frames.ROWS_BUFFER_MAX)


SHARD_COUNTS = (1, 2, 5, 16, 17, 40)


@pytest.fixture(scope="module")
def clients():
    """A client per shard count (no shard answers: owners() needs none)."""
    made = {n: PSClient(["127.0.0.1:1"] * n, data_plane="grpc") for n in SHARD_COUNTS}
    yield made
    for c in made.values():
        c.close()


@settings(max_examples=60, deadline=None)
@given(ids=st.lists(st.integers(-2**63, 2**63 - 1), max_size=300), shards=st.sampled_from(SHARD_COUNTS))
def test_the_client_splits_a_lookup_by_owner_in_order(clients, ids, shards):
    """owners(): for each shard, the positions of the unique ids it holds, ascending; all of
    them, each once (a pass per shard up to 16 shards, a sort beyond)."""
    lk = TableLookup.of(np.array(ids, np.int64), DIM)
    [where] = clients[shards].owners([lk])
    positions = [np.arange(lk.uniq.size)[w] for w in where]
    assert len(positions) == shards
    np.testing.assert_array_equal(np.sort(np.concatenate(positions)), np.arange(lk.uniq.size))
    owner = sparse.shard_of(lk.uniq, shards)
    for j, p in enumerate(positions):
        assert (owner[p] == j).all() and (np.diff(p) > 0).all()


# --- real clients: the same answers as gRPC -------------------------------------------------

def test_rows_over_shared_memory_equal_rows_over_grpc(shard_server):
    """Two 2-shard clusters, one driven through the data plane and one over gRPC, take the
    same batches (sizes up and down, so the rows buffer grows): every pull and every table
    state agree bit for bit."""
    fast_servers, slow_servers = cluster(shard_server, 2), cluster(shard_server, 2)
    fast, slow = client(fast_servers), client(slow_servers, "grpc")
    rng = np.random.default_rng(3)
    for step, n in enumerate([5, 3000, 1, 120_000, 17, 20_000]):
        ids = rng.integers(-2**63, 2**63, n, dtype=np.int64) if step % 2 else rng.integers(0, 500, n)
        for a, b in zip(pulled(fast, ids), pulled(slow, ids)):
            np.testing.assert_array_equal(a, b)
        assert push(fast, lookups(ids, step)) == push(slow, lookups(ids, step))
    assert_same_state(table_state(fast_servers), table_state(slow_servers))
    assert all(s.fast.rows.size > 1 << 20 for s in fast.shards), "the rows buffers never grew"
    for a, b in zip(pulled(fast, np.arange(100)), pulled(slow, np.arange(100))):
        np.testing.assert_array_equal(a, b)


def test_a_first_push_with_no_rows_for_a_shard(shard_server):
    """Every shard gets the push, and the one that holds none of its ids an empty part, before
    either has a rows buffer."""
    servers = cluster(shard_server, 2)
    c = client(servers)
    ids = ids_of_shard(0, 2, 3).view(np.int64)
    assert push(c, lookups(ids, 1)) == [("aggregated", 1), ("aggregated", 1)]
    assert [s.fast.rows.size > 0 for s in c.shards] == [True, False]
    assert [shard.status()["tables"][0]["rows"] for _, shard in servers] == [3, 0]


def test_a_request_that_outgrows_the_buffer_gets_a_new_one_and_the_old_is_unmapped(shard_server):
    [(addr, shard)] = servers = cluster(shard_server)
    c = client(servers)
    pulled(c, [1, 2, 3])
    size = c.shards[0].fast.rows.size
    assert size == 1 << 20 and rows_mappings(shard) == 2        # the shard's and ours
    n = size // (8 + 4 * DIM) + 1000                                    # the emb part no longer fits
    pulled(c, np.arange(n))
    assert c.shards[0].fast.rows.size >= 2 * size
    assert rows_mappings(shard) == 2, "the old buffer must be unmapped on both sides"
    assert shard.status()["counters"]["rows_pulled"] == 2 * (3 + n)


def test_a_request_beyond_the_bound_goes_over_grpc(shard_server, monkeypatch):
    monkeypatch.setattr(frames, "ROWS_BUFFER_MAX", 4096)
    servers = cluster(shard_server)
    c, ref = client(servers), client(cluster(shard_server), "grpc")
    ids = np.arange(1000)                                     # 1000 * 24 bytes > 4096
    push(c, lookups(ids, 1))
    push(ref, lookups(ids, 1))
    for a, b in zip(pulled(c, ids), pulled(ref, ids)):
        np.testing.assert_array_equal(a, b)
    assert c.shards[0].fast is not None and c.shards[0].fast.rows.size == 0
    assert servers[0][1].status()["tables"][0]["rows"] == 1000


# --- hostile clients -------------------------------------------------------------------------

def raw_connection(shard, c: PSClient) -> socket.socket:
    """HELLO by hand as worker c (no token), its two fds closed at once."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(10)
    sock.connect(shard.dataplane.path)
    fields = [b"", c.shards[0].session.encode()]
    sock.sendall(frames.REQUEST.pack(frames.MAGIC, frames.HELLO, c.rank, 0, 0, 0, 0, 0, 0)
                 + b"".join(frames.TOKEN_LEN.pack(len(f)) + f for f in fields))
    msg, fds, _, _ = socket.recv_fds(sock, frames.REPLY.size, 2)
    assert frames.REPLY.unpack(msg)[0] == 0
    for fd in fds:
        os.close(fd)
    return sock


def request(sock, op, num_elements=0, tail=b"", step=0):
    sock.sendall(frames.REQUEST.pack(frames.MAGIC, op, 0, 0, step, 0, num_elements, 1, 5000) + tail)


def reply(sock) -> tuple[int, str]:
    code, _, _, _, n, _ = frames.REPLY.unpack(frames.recv_exact(sock, frames.REPLY.size))
    return code, frames.recv_exact(sock, n).decode() if n else ""


def grow(sock, nbytes: int) -> int:
    """ROWS_BUFFER by hand: the fd of the new buffer (the caller closes it)."""
    request(sock, frames.ROWS_BUFFER, nbytes)
    msg, fds, _, _ = socket.recv_fds(sock, frames.REPLY.size, 1)
    code, _, _, _, n, size = frames.REPLY.unpack(msg)
    assert code == 0 and len(fds) == 1 and size >= nbytes
    return fds[0]


def parts_tail(*parts) -> bytes:
    return frames.PARTS.pack(len(parts)) + b"".join(frames.PART.pack(*p) for p in parts)


def test_the_rows_buffer_is_sealed_and_bounded(shard_server):
    [(addr, shard)] = servers = cluster(shard_server)
    c = client(servers)
    sock = raw_connection(shard, c)
    fd = grow(sock, 100)
    size = os.fstat(fd).st_size
    for new_size in (0, size // 2, 2 * size):
        with pytest.raises(PermissionError):
            os.ftruncate(fd, new_size)
    os.close(fd)
    for _ in range(6):                 # asking again and again: the shard keeps one mapping
        os.close(grow(sock, 100))
    assert rows_mappings(shard) == 1
    request(sock, frames.ROWS_BUFFER, frames.ROWS_BUFFER_MAX + 1)
    code, message = reply(sock)
    assert frames.CODES[code] == "INVALID_ARGUMENT" and "rows buffer" in message
    request(sock, frames.ROWS_BUFFER, -5)
    assert frames.CODES[reply(sock)[0]] == "INVALID_ARGUMENT"
    os.close(grow(sock, 100))          # the connection still serves
    sock.close()


@pytest.mark.parametrize("case, error", [
    ("no_buffer", "rows buffer holds 0"), ("too_big", "rows buffer holds"),
    ("no_table", "index 2; the model has 2 sparse tables"), ("wrong_shard", "lives on shard"),
    ("nan", "non-finite"), ("repeated", "ids repeat"), ("twice", "appears twice"),
])
def test_a_refused_sparse_push_changes_nothing(shard_server, case, error):
    servers = cluster(shard_server, 2)
    c = client(servers)
    shard = servers[0][1]
    push(c, lookups(np.arange(50), 1))
    before = table_state(servers)
    sock = raw_connection(shard, c)
    ids = ids_of_shard(0, 2, 4)
    if case == "wrong_shard":
        ids[-1] = ids_of_shard(1, 2, 1)[0]
    if case == "repeated":
        ids[-1] = ids[0]
    grads = np.ones((4, DIM), np.float32)
    if case == "nan":
        grads[2, 1] = np.nan
    if case != "no_buffer":
        fd = grow(sock, 100)
        buf = np.frombuffer(frames.mapped(fd, os.fstat(fd).st_size, True, "test"), np.uint8)
        os.close(fd)
        buf[:32] = ids.view(np.uint8)
        buf[32:32 + grads.nbytes] = grads.reshape(-1).view(np.uint8)
    n = {"too_big": 10**6}.get(case, 4)
    table = {"no_table": 2}.get(case, 0)
    parts = [(table, n)] * (2 if case == "twice" else 1)
    request(sock, frames.PUSH_ROWS, shard.store.size, parts_tail(*parts), step=shard.store.version)
    code, message = reply(sock)
    assert frames.CODES[code] == "INVALID_ARGUMENT" and error in message
    assert_same_state(table_state(servers), before)
    sock.close()


def test_more_parts_than_tables_are_refused_and_the_connection_closed(shard_server):
    servers = cluster(shard_server)
    c = client(servers)
    sock = raw_connection(servers[0][1], c)
    request(sock, frames.PULL_ROWS, 0, frames.PARTS.pack(1 << 30))     # no parts follow
    code, message = reply(sock)
    assert frames.CODES[code] == "INVALID_ARGUMENT" and "1073741824 parts" in message
    assert sock.recv(1) == b""
    sock.close()
    for a, b in zip(pulled(c, [1, 2]), pulled(client(cluster(shard_server), "grpc"), [1, 2])):
        np.testing.assert_array_equal(a, b)


def test_a_pull_names_one_table_that_fits(shard_server):
    servers = cluster(shard_server)
    c = client(servers)
    fast = c.shards[0].fast
    with pytest.raises(InvalidArgument, match="no sparse table 'nope'"):
        fast.pull_rows("nope", np.arange(3, dtype=np.uint64), np.empty((3, DIM), np.float32), 5)
    sock = raw_connection(servers[0][1], c)
    os.close(grow(sock, 100))
    request(sock, frames.PULL_ROWS, 0, parts_tail((0, 1), (1, 1)))
    assert "names one table" in reply(sock)[1]
    request(sock, frames.PULL_ROWS, 0, parts_tail((0, 10**6)))
    assert "rows buffer holds" in reply(sock)[1]
    sock.close()


def test_what_the_shard_checked_is_what_it_applies(shard_server):
    """Sync, 2 workers: worker 0 pushes rows through shared memory, then writes NaN over its
    rows buffer before the step completes. The step applies the rows as they were pushed."""
    servers = cluster(shard_server, num_workers=2)
    a, b = client(servers, rank=0, num_workers=2), client(servers, rank=1, num_workers=2)
    ids = np.array([4, 5, 6])
    start = pulled(a, ids)
    la, lb = lookups(ids, 1), lookups(ids, 2)
    a.push(np.zeros(LAYOUT.total, np.float32), 1, lookups=la, tables=[t.name for t in TABLES])
    buf = a.shards[0].fast.rows
    buf.region(0, np.float32, buf.size // 4)[:] = np.nan               # the step still waits for b
    b.push(np.zeros(LAYOUT.total, np.float32), 1, lookups=lb, tables=[t.name for t in TABLES])
    a.pull(np.empty(LAYOUT.total, np.float32))
    emb = pulled(a, ids)[0]
    mean = (la[0].grads[la[0].inverse] + lb[0].grads[lb[0].inverse]) / 2
    np.testing.assert_allclose(emb, start[0] - TABLES[0].lr * mean, rtol=1e-6)
    assert servers[0][1].status()["counters"]["pushes_rejected"] == 0
