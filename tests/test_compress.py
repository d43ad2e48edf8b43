"""Push compression: codec error bounds, numba decoders against their NumPy twins, error
feedback's conservation of the gradient sum, and malformed compressed pushes over real gRPC."""

from __future__ import annotations

import grpc
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from pserver._proto import pserver_pb2 as pb
from pserver._proto import pserver_pb2_grpc as pb_grpc
from pserver.errors import ConfigError, InvalidArgument
from pserver.server import compress as server_compress
from pserver.wire import codec, compress
from pserver.worker import compress as worker_compress
from pserver.worker.client import PSClient
from tests.support.clients import LAYOUT, raw_push, ready_client

SPECS = [compress.parse(s) for s in ("bf16", "fp16", "topk:0.1", "topk:1", "sign")]
finite = st.floats(-1e4, 1e4, width=32, allow_subnormal=False)
grads = st.integers(0, 3 * compress.BLOCK + 5).flatmap(lambda n: arrays(np.float32, n, elements=finite))


def round_trip(spec, g):
    packed = compress.encode(spec, g)
    out = np.empty_like(g)
    parts = [np.frombuffer(a.tobytes(), a.dtype) for a in packed.arrays]   # as the wire gives them
    header = pb.TensorHeader(compression=packed.compression, num_values=packed.num_values, scale=packed.scale)
    compress.decode(header, parts, out)
    return packed, out


@settings(max_examples=40, deadline=None)
@given(g=grads)
def test_bf16_is_within_half_a_bf16_ulp(g):
    _, d = round_trip(compress.parse("bf16"), g)
    assert np.all(np.abs(d - g) <= np.abs(g) * 2.0 ** -8)


@settings(max_examples=40, deadline=None)
@given(g=grads)
def test_fp16_is_within_half_an_fp16_ulp_of_the_scaled_value(g):
    packed, d = round_trip(compress.parse("fp16"), g)
    assert np.all(np.abs(g) * packed.scale < 2.0 ** 15), "the scale must leave no overflow"
    assert np.all(np.abs(d - g) <= np.abs(g) * 2.0 ** -11 + 2.0 ** -25 / packed.scale)


@settings(max_examples=40, deadline=None)
@given(g=grads, ratio=st.floats(0.001, 1.0))
def test_topk_keeps_the_largest_of_each_block_exactly(g, ratio):
    packed, d = round_trip(compress.Spec("topk", ratio), g)
    kept = d != 0
    np.testing.assert_array_equal(d[kept], g[kept])
    for start in range(0, g.size, compress.BLOCK):
        blk, got = np.abs(g[start:start + compress.BLOCK]), packed.arrays[0]
        mine = got[(got >= start) & (got < start + blk.size)] - start
        assert mine.size == min(blk.size, max(1, int(np.ceil(ratio * blk.size))))
        dropped = np.delete(blk, mine)
        assert dropped.size == 0 or dropped.max() <= blk[mine].min()


@settings(max_examples=40, deadline=None)
@given(g=grads)
def test_sign_sends_the_sign_times_the_blocks_mean_magnitude(g):
    _, d = round_trip(compress.parse("sign"), g)
    for start in range(0, g.size, compress.BLOCK):
        blk = g[start:start + compress.BLOCK]
        mean = np.float32(np.abs(blk, dtype=np.float64).mean())
        np.testing.assert_array_equal(d[start:start + blk.size], np.where(blk >= 0, mean, -mean))


@settings(max_examples=30, deadline=None)
@given(g=grads, spec=st.sampled_from(SPECS))
def test_numba_decoders_match_their_numpy_twins(g, spec):
    packed, fast = round_trip(spec, g)
    twin = np.empty_like(g)
    compress.decode_ref(packed, twin)
    np.testing.assert_array_equal(fast.view(np.uint32), twin.view(np.uint32))


@pytest.mark.parametrize("kernel, twin, args", [
    (compress.topk_decode, compress.topk_decode_ref, (np.array([1, 5, 5], "<u4"), np.ones(3, "<f4"))),
    (compress.topk_decode, compress.topk_decode_ref, (np.array([1, 9], "<u4"), np.ones(2, "<f4"))),
    (compress.topk_decode, compress.topk_decode_ref, (np.array([4, 2], "<u4"), np.ones(2, "<f4"))),
    (compress.sign_decode, compress.sign_decode_ref, (np.zeros(1, np.uint8), np.array([np.nan], "<f4"), 8)),
    (compress.sign_decode, compress.sign_decode_ref, (np.zeros(1, np.uint8), np.array([-1.0], "<f4"), 8)),
])
def test_kernels_and_twins_find_the_same_bad_entry(kernel, twin, args):
    assert kernel(*args, np.empty(8, np.float32)) == twin(*args, np.empty(8, np.float32)) >= 0


@settings(max_examples=25, deadline=None)
@given(steps=st.lists(arrays(np.float32, 300, elements=st.floats(-10, 10, width=32)), min_size=1, max_size=8),
       spec=st.sampled_from(SPECS))
def test_error_feedback_loses_nothing_in_sum(steps, spec):
    """sum of what the shards decode + the final residual == sum of the raw gradients."""
    fb = worker_compress.ErrorFeedback(spec, 300)
    received = np.zeros(300, np.float64)
    for g in steps:
        for start, end in ((0, 120), (120, 300)):       # two shards' slices
            packed = fb.pack(g, start, end)
            out = np.empty(end - start, np.float32)
            compress.decode_ref(packed, out)
            received[start:end] += out
    raw = np.sum(steps, axis=0, dtype=np.float64)
    np.testing.assert_allclose(received + fb.residual, raw, rtol=0, atol=1e-4 * (1 + np.abs(raw).max()))


@pytest.mark.parametrize("text", ["gzip", "topk", "topk:0", "topk:1.5", "topk:x", "bf16:2"])
def test_a_bad_codec_names_the_flag_and_value(text):
    with pytest.raises(ConfigError, match=f"--compress: .*{text.split(':')[-1]}"):
        compress.parse(text)


def compressed_push(address, session, mutate):
    g = np.linspace(-1, 1, LAYOUT.total, dtype=np.float32)
    packed = compress.encode(compress.parse(mutate[0]), g)
    h = pb.TensorHeader(rank=0, shard=0, step=0, num_samples=1, session=session,
                        compression=packed.compression, num_values=packed.num_values, scale=packed.scale)
    mutate[1](h, packed.arrays)
    return raw_push(address, list(codec.encode_parts(h, packed.arrays, 64, LAYOUT.total)))


BAD = {
    "repeated index": ("topk:0.5", lambda h, a: a[0].__setitem__(1, a[0][0]), "topk: index"),
    "index out of range": ("topk:0.5", lambda h, a: a[0].__setitem__(-1, 33), "topk: index 33"),
    "num_values too many": ("topk:0.5", lambda h, a: setattr(h, "num_values", 34),
                            "num_values: topk sent 34"),
    "wrong length": ("topk:0.5", lambda h, a: setattr(h, "num_values", 3), "more than"),
    "NaN scale": ("sign", lambda h, a: a[1].__setitem__(0, np.nan), "sign: block 0"),
    "zero fp16 scale": ("fp16", lambda h, a: setattr(h, "scale", 0.0), "scale: fp16"),
    "unknown codec": ("bf16", lambda h, a: setattr(h, "compression", "zstd"), "compression: 'zstd'"),
    "bf16 Inf": ("bf16", lambda h, a: a[0].__setitem__(3, 0x7F80), "non-finite"),
}


@pytest.mark.parametrize("case", BAD, ids=list(BAD))
def test_a_malformed_compressed_push_is_rejected_and_changes_nothing(shard_server, case):
    addr, shard = shard_server(optimizer="sgd", lr=1.0)
    c = ready_client(addr)
    before = shard.store.params.copy()
    codec_name, mutate, words = BAD[case]
    with pytest.raises(grpc.RpcError) as e:
        compressed_push(addr, c.shards[0].session, (codec_name, mutate))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and words in e.value.details()
    np.testing.assert_array_equal(shard.store.params, before)
    assert shard.store.version == 0 and not shard.policy.pending
    # A good compressed push still goes through afterwards.
    compressed_push(addr, c.shards[0].session, ("topk:0.5", lambda h, a: None))
    assert shard.store.version == 1


@pytest.mark.parametrize("plane", ["grpc", "auto"])
@pytest.mark.parametrize("spec", ["bf16", "fp16", "topk:0.3", "sign"])
def test_client_pushes_compressed_over_either_plane_with_error_feedback(shard_server, plane, spec):
    """What the shard applies is what the worker decoded; the residual holds the rest."""
    addr, shard = shard_server(optimizer="sgd", lr=1.0)
    c = PSClient([addr], rpc_deadline=10, data_plane=plane, compression=spec)
    c.connect(5)
    c.register(LAYOUT)
    c.init(np.zeros(LAYOUT.total, np.float32))
    assert "compressed" in c.plane_description()
    g = np.linspace(-3, 3, LAYOUT.total, dtype=np.float32)
    w = np.empty(LAYOUT.total, np.float32)
    c.pull(w)
    assert c.push(g, num_samples=1) == [("aggregated", 1)]
    c.pull(w)
    np.testing.assert_allclose(-w + c.feedback.residual, g, atol=1e-6)
    assert shard.status()["counters"]["pushes_aggregated"] == 1


# ---- bf16 pulls ----

any_float32 = st.floats(width=32, allow_nan=False, allow_infinity=False)


@settings(max_examples=60, deadline=None)
@given(w=st.integers(0, 5000).flatmap(lambda n: arrays(np.float32, n, elements=any_float32)))
def test_the_shards_bf16_encoder_matches_its_numpy_twin(w):
    out = np.empty(w.size, np.uint16)
    compress.bf16_encode(w, out)
    np.testing.assert_array_equal(out, compress.bf16_bits(w))


def test_bf16_rounds_ties_to_even_in_the_kernel_and_its_twin():
    # upper half even or odd, lower half just below, at and just above the halfway point
    upper = np.array([0x3F80, 0x3F81], np.uint32)              # 1.0 and the bf16 number above it
    lower = np.array([0x7FFF, 0x8000, 0x8001], np.uint32)
    u = (upper[:, None] << 16 | lower[None, :]).reshape(-1)
    want = np.array([0x3F80, 0x3F80, 0x3F81,                  # even: a tie stays
                     0x3F81, 0x3F82, 0x3F82], np.uint16)      # odd: a tie goes up to even
    out = np.empty(u.size, np.uint16)
    compress.bf16_encode(u.view(np.float32), out)
    np.testing.assert_array_equal(out, want)
    np.testing.assert_array_equal(compress.bf16_bits(u.view(np.float32)), want)


@pytest.mark.parametrize("chunk_bytes", [1, 2, 3, 64, 77])
def test_a_bf16_pull_is_made_a_chunk_at_a_time(chunk_bytes):
    params = np.linspace(-1, 1, 101, dtype=np.float32)
    blocks = list(server_compress.pull_payload(params, "bf16", chunk_bytes))
    np.testing.assert_array_equal(np.concatenate(blocks), compress.bf16_bits(params))
    full = max(2, chunk_bytes - chunk_bytes % 2)              # whole uint16s, at least one
    assert all(b.nbytes == full for b in blocks[:-1]) and 0 < blocks[-1].nbytes <= full
    assert server_compress.pull_payload(params, "", chunk_bytes) == [params]


def test_the_worker_refuses_a_pull_the_shard_sent_wrong():
    dest = np.empty(4, np.float32)
    scratch = lambda n: np.empty(n, np.uint16)  # noqa: E731
    with pytest.raises(InvalidArgument, match="num_elements: shard sent 3, expected 4"):
        worker_compress.receive_pull(pb.TensorHeader(num_elements=3), iter(()), dest, scratch)
    with pytest.raises(InvalidArgument, match="compression: the shard sent a pull as 'zstd'"):
        worker_compress.receive_pull(pb.TensorHeader(num_elements=4, compression="zstd"), iter(()),
                                     dest, scratch)


@pytest.mark.parametrize("text, want", [("", "none"), (None, "none"), ("none", "none"), ("bf16", "bf16")])
def test_pull_compress_defaults_to_none(text, want):
    assert compress.parse_pull(text) == want


@pytest.mark.parametrize("chunk_bytes", [1 << 20, 64, 77])   # one message; many; uint16s across chunks
@pytest.mark.parametrize("plane", ["grpc", "auto"])
def test_a_bf16_pull_gives_the_weights_rounded_and_leaves_the_shard_float32(shard_server, chunk_bytes, plane):
    addr, shard = shard_server(optimizer="sgd", lr=1.0, chunk_bytes=chunk_bytes)
    c = PSClient([addr], rpc_deadline=10, data_plane=plane, pull_compression="bf16")
    c.connect(5)
    c.register(LAYOUT)
    w0 = np.linspace(-3.3, 2.9, LAYOUT.total, dtype=np.float32) * np.float32(1.001)
    c.init(w0)
    w = np.empty(LAYOUT.total, np.float32)
    c.pull(w)
    rounded = np.empty_like(w0)
    compress.bf16_decode_ref(compress.bf16_bits(w0), rounded)
    assert not np.array_equal(rounded, w0)            # the test data loses bits in bf16
    np.testing.assert_array_equal(w, rounded if plane == "grpc" else w0)
    # The shard keeps and updates float32: a push of g moves it by exactly -g.
    g = np.full(LAYOUT.total, 0.25, np.float32)
    c.push(g, num_samples=1)
    c.pull(w)
    np.testing.assert_array_equal(shard.store.params, w0 - g)
    assert ("gRPC pulls in bf16" if plane == "grpc" else "pulls over shared memory stay float32") \
        in c.plane_description()


def test_a_pull_asking_for_an_unknown_codec_is_refused_before_it_waits(shard_server):
    addr, shard = shard_server(optimizer="sgd", lr=1.0)
    c = ready_client(addr)
    stub = pb_grpc.ParameterServerStub(grpc.insecure_channel(addr))
    req = pb.PullRequest(rank=0, shard=0, seen_version=0, clock=0, session=c.shards[0].session,
                         compression="zstd")   # seen_version 0 would wait for version 1 in sync mode
    with pytest.raises(grpc.RpcError) as e:
        list(stub.Pull(req, timeout=5))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "'zstd'" in e.value.details()
    assert shard.status()["counters"]["pulls_served"] == 0


def test_a_bad_pull_codec_names_the_flag():
    with pytest.raises(ConfigError, match="--pull-compress: 'fp16' is not one of none, bf16"):
        PSClient(["127.0.0.1:1"], pull_compression="fp16")
