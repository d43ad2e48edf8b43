"""Sparse tables through real gRPC shards: Register with tables, PullRows, pushes that carry
rows, the four modes, rejections that change nothing, checkpoints and status."""

from __future__ import annotations

import grpc
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pserver import sparse
from pserver._proto import pserver_pb2 as pb
from pserver._proto import pserver_pb2_grpc as pb_grpc
from pserver.errors import InvalidArgument
from pserver.models.layout import Layout
from pserver.persist import checkpoint
from pserver.sparse import TableConfig, TableLookup
from pserver.wire import codec
from pserver.worker.client import PSClient

DIM = 4
TABLE = TableConfig("emb", DIM, optimizer="sgd", lr=0.5, init_scale=0.1, seed=7)
LAYOUT = Layout.of([("b", (3,))], [TABLE])


def cluster(shard_server, num_shards=2, **cfg):
    return [shard_server(shard=j, num_shards=num_shards, optimizer="sgd", lr=1.0, **cfg)
            for j in range(num_shards)]


def client(servers, rank=0, num_workers=1, init=True):
    c = PSClient([a for a, _ in servers], rank=rank, num_workers=num_workers, rpc_deadline=120,
                 data_plane="grpc")
    c.connect(5)
    c.register(LAYOUT)
    if init and rank == 0:
        c.init(np.zeros(LAYOUT.total, np.float32))
    return c


def initial(ids) -> np.ndarray:
    out = np.empty((len(ids), DIM), np.float32)
    sparse.initial_rows(np.asarray(ids, np.uint64), DIM, TABLE.seed, 0, TABLE.init_scale, out)
    return out


def pulled(c: PSClient, ids) -> np.ndarray:
    lk = TableLookup.of(np.asarray(ids, np.int64), DIM)
    c.pull_rows([lk], ["emb"])
    return lk.rows[lk.inverse]


def lookup_with_grads(ids, grads) -> TableLookup:
    lk = TableLookup.of(np.asarray(ids, np.int64), DIM)
    lk.grads[:] = sparse.segment_sum(np.asarray(grads, np.float32), lk.inverse, lk.uniq.size)
    return lk


def push(c: PSClient, lk: TableLookup, dense=None, num_samples=1):
    dense = np.zeros(LAYOUT.total, np.float32) if dense is None else dense
    return c.push(dense, num_samples=num_samples, lookups=[lk], tables=["emb"])


def rows_on_shards(servers) -> int:
    return sum(shard.store.tables["emb"].stats()["rows"] for _, shard in servers)


def test_unknown_ids_read_their_initial_value_and_create_nothing(shard_server):
    servers = cluster(shard_server)
    c = client(servers)
    ids = [5, -1, 2**40, 5]          # negative int64 ids map to uint64 bit for bit
    np.testing.assert_array_equal(pulled(c, ids), initial(np.array(ids, np.int64).view(np.uint64)))
    assert rows_on_shards(servers) == 0


def test_sync_averages_each_row_over_the_samples_of_the_step(shard_server):
    """Worker 0 touches ids 1 and 2 with a batch of 1 sample, worker 1 only id 2 with 3 samples:
    id 1 moves by 1/4 of worker 0's gradient (worker 1 adds zero, but its samples count), id 2
    by (1 g0 + 3 g1) / 4. Fails for a row averaged over the workers (or the samples) that
    touched it, or for an unweighted mean."""
    servers = cluster(shard_server, num_workers=2)
    c0, c1 = client(servers, 0, 2), client(servers, 1, 2)
    w = np.empty(LAYOUT.total, np.float32)
    c0.pull(w)
    c1.pull(w)
    g0 = np.arange(2 * DIM, dtype=np.float32).reshape(2, DIM)
    g1 = np.full((1, DIM), 4.0, np.float32)
    push(c0, lookup_with_grads([1, 2], g0), num_samples=1)
    push(c1, lookup_with_grads([2], g1), num_samples=3)
    c0.pull(w)
    want = initial([1, 2]) - TABLE.lr * np.stack([g0[0] / 4, (g0[1] + 3 * g1[0]) / 4])
    np.testing.assert_allclose(pulled(c0, [1, 2]), want, rtol=1e-6)
    assert rows_on_shards(servers) == 2
    # What Prometheus scrapes says the same: 2 rows updated (id 2's two gradients are one update),
    # and the rows each shard holds.
    metric = lambda shard, name, labels: shard.metrics.registry.get_sample_value(name, labels)  # noqa: E731
    assert sum(metric(s, "pserver_rows_total", {"direction": "pushed"}) for _, s in servers) == 2
    for _, s in servers:
        stats = s.store.tables["emb"].stats()
        assert metric(s, "pserver_table_rows", {"table": "emb"}) == stats["rows"]
        assert metric(s, "pserver_table_bytes", {"table": "emb"}) == stats["bytes"] > 0


@pytest.mark.parametrize("mode", ["async", "ssp"])
def test_async_modes_apply_rows_on_arrival(shard_server, mode):
    servers = cluster(shard_server, mode=mode, num_workers=2)
    c0 = client(servers, 0, 2)
    w = np.empty(LAYOUT.total, np.float32)
    c0.pull(w)
    g = np.ones((1, DIM), np.float32)
    assert {o for o, _ in push(c0, lookup_with_grads([9], g))} == {"applied"}
    np.testing.assert_allclose(pulled(c0, [9]), initial([9]) - TABLE.lr * g, rtol=1e-6)


def test_backup_drops_late_rows_with_their_push(shard_server):
    servers = cluster(shard_server, mode="backup", backup_workers=1, num_workers=2)
    c0, c1 = client(servers, 0, 2), client(servers, 1, 2)
    w = np.empty(LAYOUT.total, np.float32)
    c0.pull(w)
    c1.pull(w)
    push(c0, lookup_with_grads([3], np.ones((1, DIM))))
    outcomes = {o for o, _ in push(c1, lookup_with_grads([4], np.ones((1, DIM))))}
    assert outcomes == {"dropped_late"}
    np.testing.assert_allclose(pulled(c0, [3, 4]),
                               initial([3, 4]) - TABLE.lr * np.array([[1.0] * DIM, [0.0] * DIM]), rtol=1e-6)


def raw_push(address, header: pb.TensorHeader, payload: bytes):
    stub = pb_grpc.ParameterServerStub(grpc.insecure_channel(address))
    msgs = [pb.TensorChunk(header=header), pb.TensorChunk(data=payload)]
    return stub.Push(iter(msgs), timeout=5)


def ids_of_shard(j: int, num_shards: int, n: int) -> np.ndarray:
    cand = np.arange(1, 50 * n, dtype=np.uint64)
    return cand[sparse.shard_of(cand, num_shards) == j][:n]


@pytest.mark.parametrize("case, field", [
    ("wrong_shard", "lives on shard"), ("repeated", "ids repeat"), ("nan", "non-finite"),
    ("no_table", "no sparse table"), ("truncated", "truncated"), ("twice", "appears twice"),
])
def test_a_rejected_sparse_push_changes_nothing(shard_server, case, field):
    servers = cluster(shard_server)
    c = client(servers)
    w = np.empty(LAYOUT.total, np.float32)
    c.pull(w)
    addr, shard = servers[0]
    mine, theirs = ids_of_shard(0, 2, 3), ids_of_shard(1, 2, 1)
    ids = {"wrong_shard": np.concatenate([mine[:2], theirs]), "repeated": mine[[0, 1, 0]]}.get(case, mine)
    grads = np.ones((3, DIM), np.float32)
    if case == "nan":
        grads[1, 2] = np.nan
    parts = [pb.SparsePart(table="nope" if case == "no_table" else "emb", num_ids=3)]
    if case == "twice":
        parts = parts * 2
    payload = (np.zeros(shard.store.size, np.float32).tobytes()
               + (ids.tobytes() + grads.tobytes()) * len(parts))
    if case == "truncated":
        payload = payload[:-4]
    header = pb.TensorHeader(rank=0, shard=0, step=shard.store.version, num_elements=shard.store.size,
                             dtype="float32", num_samples=1, session=c.shards[0].session, sparse=parts)
    before = shard.store.params.copy(), shard.store.version
    with pytest.raises(grpc.RpcError) as e:
        raw_push(addr, header, payload)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and field in e.value.details()
    assert rows_on_shards(servers) == 0 and shard.store.version == before[1]
    np.testing.assert_array_equal(shard.store.params, before[0])
    # the worker's own next push still counts: nothing of the rejected one was held
    push(c, lookup_with_grads(mine[:1].view(np.int64), np.ones((1, DIM))))
    assert shard.store.version == before[1] + 1 and rows_on_shards(servers) == 1


def test_pull_rows_refuses_bad_requests(shard_server):
    servers = cluster(shard_server)
    c = client(servers)
    addr, _ = servers[0]
    stub = pb_grpc.ParameterServerStub(grpc.insecure_channel(addr))
    session = c.shards[0].session
    for req, field in [
        (pb.PullRowsRequest(rank=0, shard=0, session=session, table="emb", ids=b"\x01" * 7), "whole number"),
        (pb.PullRowsRequest(rank=0, shard=0, session=session, table="other", ids=b""), "no sparse table"),
        (pb.PullRowsRequest(rank=0, shard=0, session=session, table="emb",
                            ids=ids_of_shard(1, 2, 1).tobytes()), "lives on shard"),
    ]:
        with pytest.raises(grpc.RpcError) as e:
            list(stub.PullRows(req, timeout=5))
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and field in e.value.details()
    with pytest.raises(grpc.RpcError) as e:
        list(stub.PullRows(pb.PullRowsRequest(rank=0, shard=0, session="x" * 32, table="emb"), timeout=5))
    assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED


def test_a_worker_with_other_tables_is_refused(shard_server):
    servers = cluster(shard_server)
    client(servers)
    other = PSClient([a for a, _ in servers], rank=0, num_workers=1, rpc_deadline=5, data_plane="grpc")
    other.connect(5)
    with pytest.raises(Exception, match="does not match"):
        other.register(Layout.of([("b", (3,))], [TableConfig("emb", DIM + 1, optimizer="sgd")]))


def test_a_tables_optimizer_params_reach_the_shard_and_set_its_steps(shard_server):
    """Register carries params as a map: the shard's table must run with them (adagrad's first
    step is lr g / sqrt(initial_accumulator + g^2)), not refuse them or fall back to defaults."""
    table = TableConfig("emb", DIM, optimizer="adagrad", lr=0.5, init_scale=0.0,
                        params={"initial_accumulator": 3.0, "eps": 0.0})
    layout = Layout.of([("b", (3,))], [table])
    servers = cluster(shard_server)
    c = PSClient([a for a, _ in servers], rank=0, num_workers=1, rpc_deadline=30, data_plane="grpc")
    c.connect(5)
    c.register(layout)
    c.init(np.zeros(layout.total, np.float32))
    c.pull(np.empty(layout.total, np.float32))
    assert {shard.store.tables["emb"].config for _, shard in servers} == {table}
    ids = [5, 6, 7, 8]
    lk = TableLookup.of(np.asarray(ids, np.int64), DIM)
    lk.grads[:] = 1.0
    c.push(np.zeros(layout.total, np.float32), num_samples=1, lookups=[lk], tables=["emb"])
    got = TableLookup.of(np.asarray(ids, np.int64), DIM)
    c.pull_rows([got], ["emb"])
    np.testing.assert_allclose(got.rows, -0.5 / np.sqrt(4.0), rtol=1e-6)


def test_register_carries_every_field_of_a_table():
    c = TableConfig("emb", 3, optimizer="ftrl", lr=0.2, init_scale=0.01, seed=9, min_count=2,
                    max_rows=100, ttl_steps=7, params={"l2": 1.0, "beta": 0.5})
    assert codec.table_config(codec.table_spec(c)) == c


@pytest.mark.parametrize("spec, words", [
    (dict(optimizer="rmsprop"), "unknown row optimizer 'rmsprop'"),
    (dict(dim=0), "dim must be an integer >= 1"),
    (dict(lr=float("nan")), "lr must be a finite number > 0"),
    (dict(params={"initial_accumulator": -1.0}), "initial_accumulator must be a finite number >= 0"),
    (dict(params={"l1": 1.0}), "adagrad takes no parameter 'l1'"),
    (dict(name=""), "name must be a non-empty string")])
def test_register_refuses_a_table_no_shard_can_run(shard_server, spec, words):
    """A raw client's bad SparseTableSpec is INVALID_ARGUMENT naming the field (not INTERNAL),
    and the shard stays unconfigured."""
    addr, shard = shard_server()
    fields = dict(name="emb", dim=DIM, optimizer="adagrad", lr=0.05) | spec
    req = pb.RegisterRequest(rank=0, num_workers=1, num_shards=1, layout=[pb.TensorSpec(name="b", shape=[3])],
                             tables=[pb.SparseTableSpec(**fields)], protocol_version=codec.PROTOCOL_VERSION)
    stub = pb_grpc.ParameterServerStub(grpc.insecure_channel(addr))
    with pytest.raises(grpc.RpcError) as e:
        stub.Register(req, timeout=5)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert words in e.value.details() and "tables:" in e.value.details()
    assert not shard.store.signature and not shard.store.tables and shard.store.params is None


def test_checkpoints_keep_the_rows_and_restore_them(shard_server, tmp_path):
    servers = cluster(shard_server, checkpoint_dir=str(tmp_path))
    c = client(servers)
    w = np.empty(LAYOUT.total, np.float32)
    c.pull(w)
    ids = np.arange(1, 40)
    push(c, lookup_with_grads(ids, np.ones((ids.size, DIM))))
    want = pulled(c, ids)
    paths = [p for p, _ in c.checkpoint()]
    assert all(paths)
    assert all(s.store.tables["emb"].threads == 2 for _, s in servers)   # --table-threads' default
    restored = [shard_server(shard=j, num_shards=2, optimizer="sgd", lr=1.0, restore=str(tmp_path),
                             table_threads=3) for j in range(2)]
    c2 = client(restored, init=False)
    np.testing.assert_array_equal(pulled(c2, ids), want)
    assert all(s.store.tables["emb"].threads == 3 for _, s in restored)
    assert rows_on_shards(restored) == ids.size
    ckpt = checkpoint.load(paths[0])
    assert ckpt.tables[0].name == "emb" and len(ckpt.rows["emb"].arrays()) > 0


def test_status_reports_each_table(shard_server):
    servers = cluster(shard_server)
    c = client(servers)
    w = np.empty(LAYOUT.total, np.float32)
    c.pull(w)
    push(c, lookup_with_grads(np.arange(10), np.ones((10, DIM))))
    tables = [t for st in c.status() for t in st.tables]
    assert [t.name for t in tables] == ["emb", "emb"]
    assert sum(t.rows for t in tables) == 10 and sum(t.creations for t in tables) == 10
    assert all(t.bytes > 0 and t.dim == DIM and t.optimizer == "sgd" for t in tables)
    assert sum(st.counters.rows_pushed for st in c.status()) == 10


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(batches=st.lists(st.lists(st.integers(-3, 20), min_size=1, max_size=12), min_size=2, max_size=3),
       data=st.data())
def test_sync_equals_one_large_batch(shard_server, batches, data):
    """N workers with batches of different sizes, each pushing its batch's mean row gradients
    and its batch's size: one sync step moves each row exactly as one process on the
    concatenated batch would (sgd), the sum over every sample divided by all the samples."""
    n = len(batches)
    servers = cluster(shard_server, num_workers=n)
    clients = [client(servers, r, n) for r in range(n)]
    w = np.empty(LAYOUT.total, np.float32)
    for c in clients:
        c.pull(w)
    total: dict[int, np.ndarray] = {}
    for c, ids in zip(clients, batches):
        grads = np.array(data.draw(st.lists(st.lists(st.integers(-4, 4), min_size=DIM, max_size=DIM),
                                            min_size=len(ids), max_size=len(ids))), np.float32)
        for i, g in zip(ids, grads):
            total[i] = total.get(i, 0) + g
        push(c, lookup_with_grads(ids, grads / len(ids)), num_samples=len(ids))
    clients[0].pull(w)
    ids = sorted(total)
    samples = sum(len(b) for b in batches)
    want = (initial(np.array(ids, np.int64).view(np.uint64))
            - TABLE.lr * np.stack([total[i] for i in ids]) / samples)
    np.testing.assert_allclose(pulled(clients[0], ids), want, rtol=1e-5, atol=1e-6)
    for c in clients:
        c.close()


def test_codec_streams_several_arrays_back_to_back():
    arrays = [np.arange(5, dtype=np.float32), np.arange(3, dtype=np.uint64),
              np.arange(6, dtype=np.float32).reshape(3, 2)]
    chunks = [codec.as_chunk(m) for m in codec.encode_parts(pb.TensorHeader(), arrays, chunk_bytes=7)]
    assert all(len(m.data) <= 7 for m in chunks)
    out = [np.empty_like(a) for a in arrays]
    header, rest = codec.read_header(iter(chunks))
    assert header.num_elements == 5
    codec.receive_into(out[0], rest, *out[1:])
    for a, b in zip(arrays, out):
        np.testing.assert_array_equal(a, b)
    with pytest.raises(InvalidArgument, match="more than"):
        codec.receive_into(out[0], codec.read_header(iter(chunks))[1], out[1])


def test_merge_rows_sums_each_tables_rows_per_id_and_keeps_every_table():
    """Several workers' parts of one step: one result per table, ids summed once each; a
    table that only one part touched is kept as it is."""
    from pserver.server.store import RowGrads, merge_rows
    one = RowGrads("a", np.array([3], np.uint64), np.ones((1, 2), np.float32))
    b0 = RowGrads("b", np.array([1, 2], np.uint64), np.array([[1, 1], [2, 2]], np.float32))
    b1 = RowGrads("b", np.array([2, 5], np.uint64), np.array([[10, 10], [5, 5]], np.float32))
    merged = {m.table: (m, scale) for m, scale in merge_rows([(one, 1), (b0, 1), (b1, 1)], total=2)}
    assert set(merged) == {"a", "b"} and merged["a"] == (one, 0.5)
    got = dict(zip(merged["b"][0].ids.tolist(), merged["b"][0].grads[:, 0].tolist()))
    assert got == {1: 1.0, 2: 12.0, 5: 5.0} and merged["b"][1] == 0.5


def test_a_merged_sum_that_overflows_is_averaged_row_by_row_and_stays_finite():
    """Two workers' finite rows whose sum passes float32's largest value: the table gets
    their mean (finite), not inf, and the ids that did not overflow keep the same mean."""
    from pserver.server.store import RowGrads, merge_rows
    big = np.float32(3e38)
    w0 = RowGrads("t", np.array([1, 2], np.uint64), np.array([[big, 1], [2, 2]], np.float32))
    w1 = RowGrads("t", np.array([1, 3], np.uint64), np.array([[big, 3], [4, 4]], np.float32))
    [(m, scale)] = merge_rows([(w0, 1), (w1, 1)], total=2)
    assert m.table == "t" and scale == 1.0 and np.isfinite(m.grads).all()
    got = {i: (m.grads[k] * np.float32(scale)).tolist() for k, i in enumerate(m.ids.tolist())}
    assert got == {1: [big, 2.0], 2: [1.0, 1.0], 3: [2.0, 2.0]}


def test_merge_rows_weighs_each_part_by_the_samples_of_its_push():
    """Parts from pushes of 1 and 3 samples in a step of 4: a table one part touched gets
    scale 1/4, not 1; ids are summed n_i g_i then scaled 1/4; parts of one count n are summed
    as they are with scale n/total; an overflowing weighted sum is scaled first and stays
    finite."""
    from pserver.server.store import RowGrads, merge_rows
    one = RowGrads("a", np.array([3], np.uint64), np.ones((1, 2), np.float32))
    b0 = RowGrads("b", np.array([1, 2], np.uint64), np.array([[1, 1], [2, 2]], np.float32))
    b1 = RowGrads("b", np.array([2, 5], np.uint64), np.array([[10, 10], [5, 5]], np.float32))
    merged = {m.table: (m, scale) for m, scale in merge_rows([(one, 1), (b0, 1), (b1, 3)], total=4)}
    assert merged["a"] == (one, 0.25) and merged["b"][1] == 0.25
    got = dict(zip(merged["b"][0].ids.tolist(), merged["b"][0].grads[:, 0].tolist()))
    assert got == {1: 1.0, 2: 32.0, 5: 15.0}
    [(m, scale)] = merge_rows([(b0, 2), (b1, 2)], total=5)       # a third push touched no row
    assert scale == 0.4 and m.grads[:, 0].tolist() == [1.0, 12.0, 5.0]
    big = np.float32(3e38)
    w0 = RowGrads("t", np.array([1, 2], np.uint64), np.array([[big, 1], [2, 2]], np.float32))
    w1 = RowGrads("t", np.array([1], np.uint64), np.array([[big, 3]], np.float32))
    [(m, scale)] = merge_rows([(w0, 1), (w1, 3)], total=4)
    assert scale == 1.0 and np.isfinite(m.grads).all()
    assert m.grads.tolist() == [[np.float32(big * np.float32(0.25)) + np.float32(big * np.float32(0.75)),
                                 np.float32(0.25) + 3 * np.float32(0.75)], [0.5, 0.5]]


def test_a_steps_row_pull_and_push_hash_its_ids_once(shard_server, monkeypatch):
    """A step pulls its rows, then pushes their gradients: the batch's ids are hashed for
    their shards once; a new batch is hashed anew, and the rows land where they belong."""
    from pserver.worker import client as client_module
    servers = cluster(shard_server, mode="async")
    c = client(servers)
    calls = []
    real = client_module.sparse.shard_of
    monkeypatch.setattr(client_module.sparse, "shard_of",
                        lambda ids, n: (calls.append(ids.size), real(ids, n))[1])
    c.pull(np.empty(LAYOUT.total, np.float32))
    ids = np.arange(40)
    lk = TableLookup.of(ids, DIM)
    c.pull_rows([lk], ["emb"])
    np.testing.assert_array_equal(lk.rows[lk.inverse], initial(ids))
    lk.grads[:] = 1
    c.push(np.zeros(LAYOUT.total, np.float32), 1, lookups=[lk], tables=["emb"])
    assert calls == [40]
    assert rows_on_shards(servers) == 40
    np.testing.assert_allclose(pulled(c, ids), initial(ids) - TABLE.lr, rtol=1e-6)    # sgd
    assert calls == [40, 40]                       # a new lookup: hashed again
    c.close()


def test_export_rows_streams_every_row_sorted_in_pages_and_checks_the_session(shard_server):
    # Catches a shard that sends its rows in storage order (the chief's merge needs them
    # ascending), pages larger than --chunk-bytes, a count that is not what follows, and an
    # ExportRows that skips PullRows' session check.
    servers = cluster(shard_server, chunk_bytes=64 * (8 + 4 * DIM))     # 64 rows a page
    c = client(servers)
    ids = np.random.default_rng(3).permutation(np.arange(1, 2001, dtype=np.int64) * 7919)
    c.pull(np.empty(LAYOUT.total, np.float32))
    push(c, lookup_with_grads(ids, np.ones((ids.size, DIM))))
    versions, total, pages = c.export_table("emb")
    pages = list(pages)
    got = np.concatenate([i for i, _ in pages])
    assert total == 2000 and versions == [1, 1] and got.tolist() == sorted(ids.tolist())
    assert np.concatenate([r for _, r in pages]).tobytes() == pulled(c, got.view(np.int64)).tobytes()
    streams = [s.export_rows(0, "emb", 5) for s in c.shards]
    for _, n, shard_pages in streams:
        shard_pages = list(shard_pages)
        assert max(len(i) for i, _ in shard_pages) == 64 and sum(len(i) for i, _ in shard_pages) == n
        assert all((np.diff(i.astype(np.float64)) > 0).all() for i, _ in shard_pages)
    stub = pb_grpc.ParameterServerStub(grpc.insecure_channel(servers[0][0]))
    with pytest.raises(grpc.RpcError) as e:
        list(stub.ExportRows(pb.ExportRowsRequest(rank=0, shard=0, session="x" * 32, table="emb"), timeout=5))
    assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
    with pytest.raises(grpc.RpcError) as e:
        list(stub.ExportRows(pb.ExportRowsRequest(rank=0, shard=0, session=c.shards[0].session, table="x"),
                             timeout=5))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "no sparse table" in e.value.details()
