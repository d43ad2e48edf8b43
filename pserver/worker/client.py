"""Talking to all shards: register, init, parallel pull and push, status, leave.

On the worker's side, `grpc.RpcError` is translated into pserver.errors here (ShardClient.call),
with the shard's index and address in the message, so a worker's user never sees a raw gRPC
traceback; the error kind in its trailing metadata picks the class (pserver.errors.KINDS).
(The shard's side has its own: pserver.wire.security turns a request stream that gRPC cut off
into a pserver error, which the servicer answers with its status code.)
"""

from __future__ import annotations

import itertools
import math
import os
import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from typing import Callable, Sequence, TypeVar

import grpc
import grpc.experimental
import numpy as np

from pserver import sparse
from pserver._proto import pserver_pb2 as pb
from pserver._proto import pserver_pb2_grpc as pb_grpc
from pserver.config import AUTO_RANK, notice_every
from pserver.errors import (
    KIND_METADATA,
    AlreadyExists,
    ConfigError,
    DeadlineExceeded,
    FailedPrecondition,
    InvalidArgument,
    JoinStepOpen,
    NotRegistered,
    OverBudget,
    PServerError,
    ResourceExhausted,
    SeenVersionAhead,
    Unavailable,
    rpc_error_for,
)
from pserver.models.layout import Layout, away_means
from pserver.observe.status import differing_settings
from pserver.records import Registration, registration_of
from pserver.signals import stopping
from pserver.wire import codec, frames
from pserver.wire import compress as codecs
from pserver.wire.security import ClientSecurity
from pserver.worker import compress, dataplane
from pserver.worker.sessions import NONE, SessionFile

T = TypeVar("T")
# gRPC's own reconnect backoff starts at 1 s and grows to 2 min; a restarted shard should
# be found within our retry loop's cadence instead.
# A pull reads its stream in the calling thread: without this, every Pull call starts a
# thread of its own to drive the channel (gRPC's default), a cost that 1 MiB round trips feel.
# Each channel keeps its own connections (a local subchannel pool): by default channels of one
# process to one address share them, and a new channel to a shard that has just started inherits
# an old channel's backoff and its "Connection refused" (a client of a gone shard on a port the
# kernel then handed to a new one failed so at once).
CHANNEL_OPTIONS = [("grpc.initial_reconnect_backoff_ms", 100), ("grpc.min_reconnect_backoff_ms", 100),
                   ("grpc.max_reconnect_backoff_ms", 2000), ("grpc.use_local_subchannel_pool", 1),
                   (grpc.experimental.ChannelOptions.SingleThreadedUnaryStream, 1)]
JOIN_TRIES = 20            # steps an elastic worker proposes before it gives up (each refused: opened)
MAX_IDS_PER_PULL = 1 << 18  # ids per PullRows request: 2 MiB, well under gRPC's 4 MiB message limit
LEAVE_ON_STOP_S = 2.0      # per shard: a stopped worker's Leave must not hold up its exit
HEARTBEAT_TIMEOUT_S = 2.0  # one beat's deadline: close() waits at most this for a beat in flight
# What ShardClient.resilient retries (a shard away, at a bound or restarted): a data-plane exchange
# sent ahead hands these to it (push_pull_sent). OverBudget, a ResourceExhausted, it does not.
RIDDEN_OUT = (Unavailable, ResourceExhausted, NotRegistered)
OUTCOMES = {pb.PushReply.APPLIED: "applied", pb.PushReply.AGGREGATED: "aggregated",
            pb.PushReply.DROPPED_LATE: "dropped_late"}


class ShardClient:
    """One shard: its channel, stub and range; every call translates gRPC errors."""

    def __init__(self, index: int, address: str, chunk_bytes: int = codec.CHUNK_BYTES,
                 data_plane: str = "auto", security: ClientSecurity = ClientSecurity(),
                 pull_compression: str = "none") -> None:
        self.index, self.address, self.chunk_bytes = index, address, chunk_bytes
        # what a gRPC pull asks the shard to send ("" float32, "bf16"), and where bf16 lands
        self.pull_codec = "" if pull_compression == "none" else pull_compression
        self.bits = np.empty(0, np.uint16)
        self.data_plane = data_plane
        self.security = security                  # token on every call, TLS when a CA is given
        self.channel = security.channel(address, CHANNEL_OPTIONS)
        self.stub = pb_grpc.ParameterServerStub(self.channel)
        # The tensor streams use the codec's hand-made TensorChunk encoding (same bytes on
        # the wire as the generated stub would send, fewer copies).
        service = "/pserver.v1.ParameterServer/"
        self.init_call = self.channel.stream_unary(service + "Init", request_serializer=codec.serialize_chunk,
                                                   response_deserializer=pb.InitReply.FromString)
        self.push_call = self.channel.stream_unary(service + "Push", request_serializer=codec.serialize_chunk,
                                                   response_deserializer=pb.PushReply.FromString)
        # The same methods for a stream of one message (header and payload fit in one chunk):
        # on the wire a client stream of one message is a unary call, and gRPC's unary call
        # needs no thread to feed it, where every streaming call starts one.
        self.assign_call = self.channel.stream_unary(
            service + "AssignWeights", request_serializer=codec.serialize_chunk,
            response_deserializer=pb.AssignWeightsReply.FromString)
        self.init_one = self.channel.unary_unary(service + "Init", request_serializer=codec.serialize_chunk,
                                                 response_deserializer=pb.InitReply.FromString)
        self.push_one = self.channel.unary_unary(service + "Push", request_serializer=codec.serialize_chunk,
                                                 response_deserializer=pb.PushReply.FromString)
        self.pull_call = self.channel.unary_stream(service + "Pull",
                                                   request_serializer=pb.PullRequest.SerializeToString,
                                                   response_deserializer=codec.parse_chunk)
        self.pull_rows_call = self.channel.unary_stream(service + "PullRows",
                                                        request_serializer=pb.PullRowsRequest.SerializeToString,
                                                        response_deserializer=codec.parse_chunk)
        self.export_rows_call = self.channel.unary_stream(
            service + "ExportRows", request_serializer=pb.ExportRowsRequest.SerializeToString,
            response_deserializer=pb.ExportRowsPage.FromString)
        self.info: Registration | None = None
        self.fast: dataplane.DataPlaneChannel | None = None   # same-host shared memory
        # The mean elements a push here carries apart (pserver.models.layout.away_means).
        self.away = np.empty(0, np.int64)
        self._joined: tuple | None = None       # Register's arguments, to join a restarted shard
        self.last_flat: np.ndarray | None = None  # where pulls land: weights to re-seed a shard
        self.reset_seen = False                   # after a rejoin, pull what the shard has
        self.auto_rank = False                    # the next Register asks shard 0 for a rank
        self.session = ""                         # our credential from Register
        self.previous = ""                        # the credential the session file kept, for the
                                                  # first Register only (a takeover at once)
        self.on_register: Callable[[], None] | None = None   # after a rejoin: keep the new session
        self.session_timeout = 0.0                # the shard expires a silent session after this
        self.down_since: float | None = None      # when the shard stopped answering
        self.down_told: float | None = None       # when we last said so (None: not yet)
        self.restart_note = ""                    # what a restarted shard had, told once it is back
        self.restarts = 0                         # times this worker found the shard restarted

    def own(self, flat: np.ndarray) -> np.ndarray:
        """This shard's range of a flat vector (of the whole model's parameters)."""
        return flat[self.info.range_start:self.info.range_end]

    @property
    def label(self) -> str:
        return f"shard {self.index} at {self.address}"

    def call(self, fn: Callable[..., T], *args, **kwargs) -> T:
        try:
            return fn(*args, **kwargs)
        except grpc.RpcError as e:
            code = e.code().name if e.code() is not None else "UNKNOWN"
            raise rpc_error_for(code, f"{self.label}: {e.details()}", error_kind(e)) from None

    def send(self, streaming, one, stream, timeout: float):
        """A client stream through `streaming`, or through `one` (the same method called as
        unary) when the stream is a single message."""
        first = next(stream)
        second = next(stream, None)
        if second is None:
            return self.call(one, first, timeout=timeout)
        return self.call(streaming, itertools.chain((first, second), stream), timeout=timeout)

    def wait_ready(self, timeout: float) -> None:
        ready = grpc.channel_ready_future(self.channel)
        try:
            ready.result(timeout=timeout)
        except grpc.FutureTimeoutError:
            # Cancelled, the future unsubscribes from the channel and gRPC's thread that polls its
            # connectivity ends; left waiting, that thread polled for as long as the process ran.
            ready.cancel()
            tls = ("is its certificate signed by --tls-ca" if self.security.tls
                   else "does it serve TLS, needing --tls-ca")
            raise Unavailable(f"shard {self.index} at {self.address}: no answer within {timeout:.3g} s "
                              f"(is `pserver serve` running there, the address right, {tls}?)") from None

    # --- riding out restarts ----------------------------------------------------------
    def resilient(self, op: Callable[[], T], retry_for: float, waits: float = 0.0) -> T:
        """Run op; on UNAVAILABLE retry with exponential backoff and jitter for up to
        `retry_for` seconds, re-registering with a shard that came back; then fail with one
        line naming the shard. RESOURCE_EXHAUSTED (the shard is at a bound, server/limits.py)
        is retried the same way (but not OverBudget: a full memory budget), and DEADLINE_EXCEEDED
        for `waits` seconds more in a call that waits (a pull whose wait ran out on the shard:
        what it waits for may still come)."""
        deadline, delay, rejoins = time.monotonic() + retry_for, 0.05, 0
        retried = (Unavailable, ResourceExhausted) + ((DeadlineExceeded,) if waits else ())
        while True:
            try:
                result = op()
                self._say_back()
                return result
            except OverBudget:
                raise                          # a memory budget: waiting frees nothing
            except retried as e:
                if stopping():
                    # A stop signal came: the shards are stopping too (a launcher's SIGTERM, a
                    # Ctrl-C). Retrying would hold this thread, and the exit that joins it, for
                    # up to retry_for seconds after the main thread has finished.
                    raise
                extra = waits if isinstance(e, DeadlineExceeded) else 0.0
                if time.monotonic() + delay > deadline + extra:
                    raise type(e)(f"{self.label}: {e.code_name.lower().replace('_', ' ')} for "
                                  f"{retry_for + extra:g} s despite retries (--rpc-deadline); "
                                  f"last error: {e}") from None
                if isinstance(e, Unavailable):
                    self._say_down(retry_for)
                    self._drop_fast()
                time.sleep(delay * random.uniform(0.5, 1.5))
                delay = min(delay * 2, 2.0)
                if isinstance(e, Unavailable):
                    self.restart_note = self._rejoin(quiet=True) or self.restart_note
            except NotRegistered:
                if self._joined is None or rejoins >= 3:
                    raise
                rejoins += 1                   # the shard restarted and forgot us: join again
                note = self._rejoin(quiet=False)
                if note:
                    print(f"{self.label} {note}", flush=True)

    def _say_down(self, retry_for: float) -> None:
        """A line when the shard has not answered twice (the first failure may be a Ctrl-C that
        stopped it and is about to stop us too: nothing to say then), then one every
        notice_every() s (10 by default)."""
        now = time.monotonic()
        if stopping():
            return
        if self.down_since is None:
            self.down_since, self.down_told = now, None
        elif self.down_told is None:
            self.down_told = now
            print(f"{self.label} unreachable, retrying for up to {retry_for:g} s (--rpc-deadline)",
                  flush=True)
        elif now - self.down_told >= notice_every():
            self.down_told = now
            print(f"{self.label} still unreachable after {now - self.down_since:.0f} s", flush=True)

    def _say_back(self) -> None:
        if self.down_since is None:
            return
        if self.down_told is None and not self.restart_note:   # a blip we did not mention
            self.down_since = None
            return
        note = f"; {self.restart_note}" if self.restart_note else ""
        print(f"{self.label} is back after {time.monotonic() - self.down_since:.1f} s{note}", flush=True)
        self.down_since, self.restart_note = None, ""

    def _rejoin(self, quiet: bool) -> str:
        """Register again (same arguments); a shard that came back empty gets the weights
        this worker last pulled, so training goes on from there. Returns what the restarted
        shard had ("" when it did not restart)."""
        if self._joined is None:
            return ""
        self._drop_fast()                    # bound to the old session, or to a dead process
        try:
            info = self._register_once(*self._joined)
            seeded = None
            if not info.initialized and self.last_flat is not None:
                rank, timeout = self._joined[0], self._joined[5]
                seeded = not self._init_once(rank, self.last_flat, timeout)
            # A restarted shard lost the gradients it was holding for its step, ours maybe
            # among them: waiting for the version after the one we saw could wait forever.
            # The next pull takes whatever it holds now, and the worker goes on from there.
            self.reset_seen = True
            self.restarts += 1
            return restart_note(info, seeded)
        except AlreadyExists:
            return ""   # the shard did not restart: it still holds our session, which goes on
        except Unavailable:
            if not quiet:
                raise
            return ""

    def _drop_fast(self) -> None:
        if self.fast is not None:
            self.fast.close()
            self.fast = None

    # --- operations -------------------------------------------------------------------
    def register(self, rank, num_workers, num_shards, layout: Layout, batch_size, timeout,
                 data_order: tuple[int, int] = (0, 0)) -> Registration:
        """Register; while an earlier session of this rank is still live on the shard (this
        worker restarted before the shard noticed), say so and wait for it to expire."""
        self._joined = (rank, num_workers, num_shards, layout, batch_size, timeout, data_order)
        deadline, told, every = time.monotonic() + timeout, -math.inf, notice_every()
        while True:
            try:
                return self.resilient(lambda: self._register_once(*self._joined, previous=self.previous),
                                      timeout)
            except AlreadyExists as e:
                now = time.monotonic()
                if now > deadline:
                    raise
                if now - told >= every:
                    told = now
                    print(f"{e}; waiting for that session to expire", flush=True)
                time.sleep(0.5)

    def _register_once(self, rank, num_workers, num_shards, layout, batch_size, timeout,
                       data_order=(0, 0), previous: str = "") -> Registration:
        """One Register. `previous`: the session file's credential, presented by the first
        Register only: a rejoin (a shard that restarted, a network blip) never presents one, or
        it would take over its own live session and lose the gradient that session holds."""
        req = pb.RegisterRequest(rank=rank, num_workers=num_workers, shard=self.index,
                                 elastic_auto_rank=self.auto_rank,
                                 num_shards=num_shards, batch_size=batch_size, previous_session=previous,
                                 data_seed=data_order[0], steps_per_epoch=data_order[1],
                                 protocol_version=codec.PROTOCOL_VERSION,
                                 layout=[codec.tensor_spec(t) for t in layout.tensors],
                                 tables=[codec.table_spec(t) for t in layout.tables])
        self.info = r = registration_of(self.call(self.stub.Register, req, timeout=timeout))
        self.away = away_means(layout.statistics_pairs(), r.range_start, r.range_end)
        if self.auto_rank:                    # a rejoin registers the rank shard 0 assigned
            self.auto_rank, rank = False, r.assigned_rank
            self._joined = (rank, *self._joined[1:])
        self.session, self.session_timeout = r.session, r.session_timeout_seconds
        self.previous = ""
        if self.on_register is not None:
            self.on_register()
        if self.data_plane == "auto" and self.fast is None:
            self.fast = dataplane.connect(r.dataplane, r.host_id, rank, self.index,
                                          r.range_end - r.range_start, self.label, self.security.token,
                                          session=self.session, tables=[t.name for t in layout.tables])
        return self.info

    def join_step(self, rank: int, step: int, timeout: float) -> int:
        """ElasticJoinStep: the step from which this shard counts the worker."""
        # Every retried call reads self.session at each attempt: a retry after a rejoin (the shard
        # restarted) must carry the new session's credential, not the one the first attempt had.
        return self.resilient(lambda: self.call(
            self.stub.ElasticJoinStep, pb.ElasticJoinStepRequest(rank=rank, session=self.session, step=step),
            timeout=timeout).member_from, timeout)

    def init(self, rank: int, flat: np.ndarray, timeout: float) -> bool:
        return self.resilient(lambda: self._init_once(rank, flat, timeout), timeout)

    def _init_once(self, rank: int, flat: np.ndarray, timeout: float) -> bool:
        if self.fast is not None:
            return self.fast.init(self.own(flat), self.info.layout_signature, timeout)
        header = pb.TensorHeader(rank=rank, shard=self.index, layout_signature=self.info.layout_signature,
                                 session=self.session)
        stream = codec.encode(header, self.own(flat), self.chunk_bytes)
        return self.send(self.init_call, self.init_one, stream, timeout).already_initialized

    def pull_into(self, flat: np.ndarray, rank: int, seen_version: int, clock: int,
                  timeout: float) -> tuple[int, bool]:
        """This shard's range, straight into flat[start:end]; returns (version, finished).
        A shard restored from an older checkpoint refuses a newer seen_version: pull what
        it has and go on from there."""
        self.last_flat = flat

        def attempt() -> tuple[int, bool]:
            seen = -1 if self.reset_seen else seen_version
            self.reset_seen = False
            try:
                return self._pull_once(flat, rank, seen, clock, timeout)
            except SeenVersionAhead:
                return self._pull_once(flat, rank, -1, clock, timeout)

        # A pull may legitimately wait for a slow worker until the shard gives up on it
        # (--step-timeout, which the shard told us as the session timeout): an attempt that
        # the shard answers DEADLINE_EXCEEDED is tried again for that long on top.
        return self.resilient(attempt, timeout, waits=2 * self.session_timeout)

    def _pull_once(self, flat, rank, seen_version, clock, timeout) -> tuple[int, bool]:
        if self.fast is not None:
            return self.fast.pull_into(self.own(flat), seen_version, clock, timeout)
        req = pb.PullRequest(rank=rank, shard=self.index, seen_version=seen_version, clock=clock,
                             session=self.session, compression=self.pull_codec)

        def run() -> tuple[int, bool]:
            header, chunks = codec.read_header(iter(self.pull_call(req, timeout=timeout)))
            compress.receive_pull(header, chunks, self.own(flat), self._bits)
            return header.step, header.finished

        return self.call(run)

    def _bits(self, n: int) -> np.ndarray:
        """The reusable uint16 array that a bf16 pull of n elements is received into."""
        if self.bits.size != n:
            self.bits = np.empty(n, np.uint16)
        return self.bits

    def pull_rows(self, rank: int, table: str, ids: np.ndarray, out: np.ndarray, timeout: float) -> None:
        """Rows of `table` for `ids` (uint64, all on this shard) into `out` (len(ids), dim):
        through shared memory in one request when its rows buffer can hold them, else over
        gRPC in requests of at most MAX_IDS_PER_PULL ids."""
        def attempt() -> None:
            if self.fast is not None and frames.fits([(ids.size, out.shape[1])]):
                self.fast.pull_rows(table, ids, out, timeout)
                return
            for a in range(0, ids.size, MAX_IDS_PER_PULL):
                b = min(a + MAX_IDS_PER_PULL, ids.size)
                self._pull_rows_once(rank, table, ids[a:b], out[a:b], timeout)

        self.resilient(attempt, timeout)

    def _pull_rows_once(self, rank, table, ids, out, timeout) -> None:
        req = pb.PullRowsRequest(rank=rank, shard=self.index, session=self.session, table=table,
                                 ids=np.ascontiguousarray(ids, dtype="<u8").tobytes())

        def run() -> None:
            header, chunks = codec.read_header(iter(self.pull_rows_call(req, timeout=timeout)))
            if header.num_elements != out.size:
                raise InvalidArgument(f"num_elements: shard sent {header.num_elements} row values, "
                                      f"expected {out.size}")
            codec.receive_into(out, chunks)

        self.call(run)

    def export_rows(self, rank: int, table: str, timeout: float):
        """(version, total rows, pages): every row of `table` on this shard, as pages of
        (ascending uint64 ids, rows) read from the stream as they are consumed (ExportRows)."""
        req = pb.ExportRowsRequest(rank=rank, shard=self.index, session=self.session, table=table)
        stream = self.call(self.export_rows_call, req, timeout=timeout)
        first = self.call(next, stream, None)
        if first is None:
            raise InvalidArgument(f"{self.label}: ExportRows sent nothing for table '{table}'")

        def page(p) -> tuple[np.ndarray, np.ndarray]:
            ids = np.frombuffer(p.ids, dtype="<u8")
            rows = np.frombuffer(p.rows, dtype=np.dtype(p.dtype).newbyteorder("<"))
            if rows.size != ids.size * p.dim:
                raise InvalidArgument(f"{self.label}: an ExportRows page of {ids.size} ids carries "
                                      f"{rows.size} values; expected {ids.size} x {p.dim}")
            return ids, rows.reshape(ids.size, p.dim)

        def pages():
            yield page(first)
            for p in iter(lambda: self.call(next, stream, None), None):
                yield page(p)
        return first.version, first.total_rows, pages()

    def push(self, grad: np.ndarray, rank: int, step: int, num_samples: int, clock: int,
             timeout: float, rows: Sequence[tuple[str, np.ndarray, np.ndarray]] = (),
             packed: codecs.Packed | None = None, lease: tuple | None = None
             ) -> tuple[str, int, bool]:
        """This shard's slice of `grad` (or `packed`, that slice compressed), and `rows`: (table,
        unique ids on this shard, their gradients) for each sparse table, in one push. `lease`:
        (epoch, chunk, batch, loss x samples, samples classed right) of the data lease this push
        carries (shard 0)."""
        return self.resilient(lambda: self._push_once(grad, rank, step, num_samples, clock, timeout, rows,
                                                      packed, lease=lease), timeout)[:3]

    def push_pull(self, grad: np.ndarray, flat: np.ndarray, rank: int, step: int, num_samples: int,
                  clock: int, seen_version: int, pull_clock: int, timeout: float,
                  rows: Sequence[tuple[str, np.ndarray, np.ndarray]] = (),
                  packed: codecs.Packed | None = None, lease: tuple | None = None
                  ) -> tuple[str, int, bool]:
        """push, then pull_into(flat, seen_version, pull_clock): (push outcome, version pulled,
        finished). Over the data plane the pull rides with the push (one exchange); over gRPC,
        after a rejoin, or when that pull fails, the pull goes on its own, exactly as
        pull_into. A refused push raises before anything is pulled."""
        self.last_flat = flat
        then = None if self.reset_seen else (self.own(flat), seen_version, pull_clock)
        outcome, _, finished, pulled = self.resilient(
            lambda: self._push_once(grad, rank, step, num_samples, clock, timeout, rows, packed, then, lease),
            timeout)
        return self._pulled(outcome, finished, pulled, flat, rank, seen_version, pull_clock, timeout)

    def _pulled(self, outcome, finished, pulled, flat, rank, seen_version, pull_clock, timeout):
        """push_pull's answer once the push is in: the pull that rode with it, else one on its own."""
        if pulled is None:
            version, pull_finished = self.pull_into(flat, rank, seen_version, pull_clock, timeout)
        else:
            version, pull_finished = pulled
        return outcome, version, finished or pull_finished

    def sends_ahead(self, rows, packed) -> bool:
        """Whether push_pull_sent can send now and take the replies later: the push goes over the
        data plane with its pull riding along, its values in one slot of the push buffer (larger
        ones go in parts, each waiting for the shard to free a slot)."""
        return self._on_plane(rows, packed) and not self.reset_seen and self.fast.slots == 1

    def push_pull_sent(self, grad: np.ndarray, flat: np.ndarray, rank: int, step: int, num_samples: int,
                       clock: int, seen_version: int, pull_clock: int, timeout: float,
                       rows: Sequence[tuple[str, np.ndarray, np.ndarray]] = (),
                       packed: codecs.Packed | None = None, lease: tuple | None = None
                       ) -> Callable[[], tuple[str, int, bool]]:
        """push_pull in two halves, where sends_ahead: the request sent now, and the call that
        takes its replies and returns push_pull's answer. A worker sends to every shard so, then
        takes each one's replies, in one thread: no thread hands a shard's exchange over (0.3 s
        of a 10 s DCN fit, two shards on two cores). Sending fails, or a reply says what
        push_pull rides out (UNAVAILABLE, RESOURCE_EXHAUSTED, NOT_REGISTERED)? Then that call
        makes the whole push_pull, riding it out as push_pull does: the same as a first attempt
        that failed so. Any other error comes from that call too, never from this one, so that
        the shards sent to before still have their replies taken."""
        def whole() -> tuple[str, int, bool]:
            return self.push_pull(grad, flat, rank, step, num_samples, clock, seen_version, pull_clock,
                                  timeout, rows, packed, lease)
        self.last_flat = flat
        then = (self.own(flat), seen_version, pull_clock)
        try:
            self.fast.send_push(self.own(grad), step, num_samples, clock, timeout, rows, then, lease)
        except Exception as e:          # raised when the replies are taken: the other shards' first
            ridden = isinstance(e, RIDDEN_OUT) and not isinstance(e, OverBudget)
            return whole if ridden else partial(_raise, e)

        def replies() -> tuple[str, int, bool]:
            try:
                outcome, _, finished, pulled = self.fast.take_push(then)
            except OverBudget:
                raise
            except RIDDEN_OUT:
                return whole()
            self._say_back()
            return self._pulled(OUTCOMES.get(outcome, "unknown"), finished, pulled, flat, rank, seen_version,
                                pull_clock, timeout)
        return replies

    def _on_plane(self, rows, packed) -> bool:
        """Whether a push goes over the data plane. It carries float32 only: a compressed push
        goes over gRPC, and so does one with statistics carried apart."""
        return (packed is None and self.fast is not None and not self.away.size
                and frames.fits([(ids.size, g.shape[1]) for _, ids, g in rows]))

    def _push_once(self, grad, rank, step, num_samples, clock, timeout, rows=(),
                   packed=None, then_pull=None, lease=None) -> tuple[str, int, bool, tuple[int, bool] | None]:
        # A data lease's progress rides in the data plane's frame (WITH_LEASE), or in gRPC's header.
        if self._on_plane(rows, packed):
            outcome, version, finished, pulled = self.fast.push(self.own(grad), step, num_samples, clock,
                                                                timeout, rows, then_pull, lease)
            return OUTCOMES.get(outcome, "unknown"), version, finished, pulled
        header = pb.TensorHeader(rank=rank, shard=self.index, step=step, num_samples=num_samples,
                                 clock=clock, session=self.session, statistics=grad[self.away],
                                 sparse=[pb.SparsePart(table=t, num_ids=ids.size) for t, ids, _ in rows])
        if lease is not None:
            header.has_lease = True
            (header.lease_epoch, header.lease_chunk, header.lease_batch, header.lease_loss_sum,
             header.lease_correct, sums) = lease
            header.lease_metric_sums.extend(sums)
        dense = [self.own(grad)]
        if packed is not None:
            header.compression, header.num_values, header.scale = (packed.compression, packed.num_values,
                                                                   packed.scale)
            dense = packed.arrays
        arrays = dense + [a for _, ids, g in rows for a in (ids, g)]
        stream = codec.encode_parts(header, arrays, self.chunk_bytes,
                                    packed.num_elements if packed is not None else None)
        reply = self.send(self.push_call, self.push_one, stream, timeout)
        return OUTCOMES.get(reply.outcome, "unknown"), reply.version, reply.finished, None

    def checkpoint(self, rank: int, timeout: float, then_stop: bool = False) -> tuple[str, int]:
        r = self.resilient(lambda: self.call(
            self.stub.Checkpoint, pb.CheckpointRequest(rank=rank, session=self.session, then_stop=then_stop),
            timeout=timeout), timeout)
        return r.path, r.version

    def status(self, timeout: float) -> pb.StatusReply:
        return self.call(self.stub.Status, pb.StatusRequest(), timeout=timeout)

    def set_lr(self, rank: int, lr: float, timeout: float) -> int:
        """The chief's new base learning rate on this shard; the version it follows."""
        return self.resilient(lambda: self.call(
            self.stub.SetLearningRate, pb.SetLearningRateRequest(rank=rank, session=self.session, lr=lr),
            timeout=timeout), timeout).version

    def assign(self, rank: int, flat: np.ndarray, expected: int, timeout: float) -> int:
        """The chief's values for this shard's range of `flat`, if the shard is still at version
        `expected` (over gRPC: a call made once at a fit's end); the version after it."""
        header = pb.TensorHeader(rank=rank, shard=self.index, step=expected, session=self.session)
        stream = codec.encode(header, self.own(flat), self.chunk_bytes)
        return self.call(lambda: self.assign_call(stream, timeout=timeout)).version

    def lease_data(self, request: pb.LeaseDataRequest, timeout: float) -> pb.LeaseDataReply:
        """LeaseData, over the data plane when this shard is on it (a fifth of gRPC's time, and the
        other workers' steps wait for this one's ask), else over gRPC."""
        def once() -> pb.LeaseDataReply:
            request.session = self.session
            if self.fast is not None:
                payload = request.SerializeToString()
                if len(payload) <= frames.MAX_MESSAGE:
                    return pb.LeaseDataReply.FromString(self.fast.lease(payload, timeout))
            return self.call(self.stub.LeaseData, request, timeout=timeout)

        return self.resilient(once, timeout)

    def leave(self, rank: int, timeout: float) -> None:
        self.call(self.stub.Leave, pb.LeaveRequest(rank=rank, session=self.session), timeout=timeout)

    def heartbeat(self, rank: int, timeout: float) -> int:
        """Keep the session live; returns the shard's version."""
        return self.call(self.stub.Heartbeat, pb.HeartbeatRequest(rank=rank, session=self.session),
                         timeout=timeout).version

    def close(self) -> None:
        if self.fast is not None:
            self.fast.close()
        self.channel.close()


def _raise(error: Exception):
    raise error


def _lease_at(lease, trained: tuple) -> tuple | None:
    """What a push to shard 0 carries with its lease: (epoch, chunk, batch, loss x samples,
    samples classed right, the compiled metrics' sums: () when `trained` has none)."""
    if lease is None:
        return None
    return (*lease, *trained[:2], tuple(trained[2]) if len(trained) > 2 else ())


def error_kind(e: grpc.RpcError) -> str:
    """The error kind a shard sent with its status (trailing metadata KIND_METADATA); "" when
    there is none: an older shard, or an error that never reached one."""
    trailing = getattr(e, "trailing_metadata", None)
    for key, value in (trailing() if trailing is not None else None) or ():
        if key == KIND_METADATA:
            return value
    return ""


def process_age() -> float | None:
    """Seconds since this process started (Linux: /proc), None where unknown."""
    try:
        with open("/proc/self/stat") as f:
            start_ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        return max(0.0, uptime - start_ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return None


def disagreement(labels: Sequence[str], settings: Sequence[dict]) -> str:
    """"" when every shard reports the same training settings, else one line naming the first
    setting that differs, shard 0 and the first shard that differs from it, and both values."""
    differ = differing_settings(list(settings))
    if not differ:
        return ""
    name, values = next(iter(differ.items()))
    j = next(j for j, v in enumerate(values) if v != values[0])
    return (f"the shards disagree on --{name.replace('_', '-')}: {labels[0]} has {values[0]!r} and "
            f"{labels[j]} has {values[j]!r}; every shard of one job must be started with the same "
            f"training settings (mode, optimizer and its hyper-parameters, schedule, step timeout, workers)")


def ask_checkpoint(client: "PSClient", say=print) -> None:
    """The chief asks every shard to checkpoint (a no-op on shards without a directory). A
    shard that cannot write one (disk full, read-only directory) says why, and training
    goes on: a lost checkpoint is no reason to lose the run. A checkpoint written is the
    shard's to log (once per version), not ours as well."""
    def ask(shard):
        try:
            return shard.checkpoint(client.rank, client.rpc_deadline)
        except FailedPrecondition as e:
            return e

    for answer in client.each(ask):
        if isinstance(answer, FailedPrecondition):
            say(f"{answer}; training goes on")


def restart_note(info: Registration, seeded: bool | None) -> str:
    """What a restarted shard had when this worker joined it again; `seeded`: whether this
    worker's Init gave it the values (None: it did not try, the shard had values)."""
    if info.restored_from:
        source = f"restored from checkpoint {info.restored_from}"
    elif seeded:
        source = "re-seeded from this worker's weights"
    elif seeded is False:
        source = "re-seeded from another worker's weights"
    elif info.seeded_by_rank >= 0:
        source = ("re-seeded from the chief's weights" if info.seeded_by_rank == 0
                  else f"re-seeded from worker {info.seeded_by_rank}'s weights")
    else:
        source = "empty: the next worker to reach it re-seeds it"
    return f"restarted at version {max(info.version, 0)}; {source}"


class PSClient:
    """All shards at once. Calls to several shards run in parallel threads (gRPC releases
    the GIL while it waits on the network), so a step costs the slowest shard, not the sum."""

    def __init__(self, addresses: Sequence[str], rank: int = 0, num_workers: int = 1,
                 chunk_bytes: int = codec.CHUNK_BYTES, rpc_deadline: float = 300.0,
                 data_plane: str = "auto", security: ClientSecurity = ClientSecurity(),
                 compression: str = "none", pull_compression: str = "none",
                 session_dir: str | None = NONE) -> None:
        """`session_dir`: where this worker keeps its session file (worker/sessions.py; None:
        the default directory; "none", the default here: no file)."""
        self.rank, self.num_workers, self.rpc_deadline = rank, num_workers, rpc_deadline
        self.session_file = SessionFile(session_dir, addresses, rank)
        self._file_lock = threading.Lock()
        self.tell_first_push = ""                # "after the takeover", "after joining": say when the
                                                 # first push is taken in
        self.compression = codecs.parse(compression)
        self.pull_compression = codecs.parse_pull(pull_compression)
        self.feedback: compress.ErrorFeedback | None = None   # made at register, sized by the layout
        self.shards = [ShardClient(j, a, chunk_bytes, data_plane, security, self.pull_compression)
                       for j, a in enumerate(addresses)]
        self._pool = ThreadPoolExecutor(max_workers=len(self.shards) - 1, thread_name_prefix="ps-client") \
            if len(self.shards) > 1 else None
        self.versions = [-1] * len(self.shards)
        # owners() of the last lookups (their ids arrays, the answer): a step's row pull and
        # its push ask for the same batch, which is hashed once
        self._owned: tuple[list[np.ndarray], list] = ([], [])
        self.finished = False          # a shard said the run is over (e.g. backup quorum gone)
        self._heartbeat: threading.Thread | None = None
        self._stop = threading.Event()

    def each_of(self, shards: list[ShardClient], fn: Callable[[ShardClient], T]) -> list[T]:
        """fn on each of `shards`, in order (a subset of self.shards; no pool: Register only)."""
        return [fn(s) for s in shards]

    def elastic_join(self, infos: list[Registration]) -> int:
        """A joining worker (rank at or above the job's initial N) in sync or backup: agree with
        every shard on the step from which it counts, j = the largest version the shards report
        + 2, proposed again from their versions then with twice the margin after a shard says it
        has opened j (join_step_open). Returns that step (0: a member from the start, or a mode
        that takes any worker's pushes)."""
        info = infos[0]
        joining = info.elastic_initial_workers <= self.rank < info.elastic_max_workers
        if joining and info.elastic_max_workers > info.elastic_initial_workers:
            self.tell_first_push = "after joining"
        if self.rank < info.elastic_initial_workers or info.mode not in ("sync", "backup"):
            return 0
        margin = 2
        for _ in range(JOIN_TRIES):
            # the shards' versions now (the kernels' warm-up came between Register and this);
            # a job whose steps outrun the proposal's round trip gets a margin twice as large
            step = max(self.each(lambda s: s.heartbeat(self.rank, self.rpc_deadline)) + [0]) + margin
            try:
                got = self.each(lambda s: s.join_step(self.rank, step, self.rpc_deadline))
            except JoinStepOpen:
                margin *= 2
                continue
            return max(got)
        raise JoinStepOpen(f"step: worker {self.rank} proposed {JOIN_TRIES} steps to join from and a "
                           f"shard had opened each one already")

    def each(self, fn: Callable[[ShardClient], T]) -> list[T]:
        """fn on every shard, in parallel; the first error (by shard order) is raised. The
        last shard's call runs in this thread, which would otherwise only wait."""
        if self._pool is None:
            return [fn(s) for s in self.shards]
        futures = [self._pool.submit(fn, s) for s in self.shards[:-1]]
        try:
            last, error = fn(self.shards[-1]), None
        except Exception as e:
            last, error = None, e
        results = [f.result() for f in futures]
        if error is not None:
            raise error
        return results + [last]

    @staticmethod
    def _taken(calls: list[Callable[[], T]]) -> list[T]:
        """Each call's result, in order, every one made; the first error (by shard order) raised
        after them all, as each raises it."""
        results, error = [], None
        for call in calls:
            try:
                results.append(call())
            except Exception as e:
                results.append(None)
                error = error or e
        if error is not None:
            raise error
        return results

    def connect(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        self.each(lambda s: s.wait_ready(max(0.1, deadline - time.monotonic())))

    def register(self, layout: Layout, batch_size: int = 0,
                 data_order: tuple[int, int] = (0, 0)) -> list[Registration]:
        """Register with every shard. `data_order` (seed, steps per epoch) is recorded with
        this rank's position, which each Registration returns (docs/semantics.md, "Resuming")."""
        # versions stay "none seen": the first pull takes whatever is current, which for
        # a restarted worker is the version the others have reached.
        if self.compression.name != "none" and any(t.momentum is not None for t in layout.tensors):
            raise ConfigError(f"--compress {self.compression.name}: the model has moving statistics "
                              "(BatchNormalization), which a lossy push would round and carry into the next "
                              "step; train it without --compress")
        if self.rank == AUTO_RANK:             # a slot no live auto worker holds, and the rank it kept
            self.session_file = SessionFile.auto_slot(self.session_file.directory,
                                                      [s.address for s in self.shards])
        kept = self.session_file.load()
        for s in self.shards:
            s.previous = kept.get(s.address, "")
        first = []
        if self.rank == AUTO_RANK:             # shard 0 assigns it; the others then hear it
            s0 = self.shards[0]
            s0.auto_rank = True
            first = [s0.register(0, self.num_workers, len(self.shards), layout, batch_size,
                                 self.rpc_deadline, data_order)]
            back = 0 < self.session_file.rank == first[0].assigned_rank
            self.rank = self.session_file.rank = first[0].assigned_rank
            print(f"worker: shard 0 assigned rank {self.rank} (--rank auto"
                  + (f"; the rank kept in {self.session_file.path})" if back else ")"), flush=True)
        rest = self.shards[len(first):]
        infos = first + self.each_of(rest, lambda s: s.register(
            self.rank, self.num_workers, len(self.shards), layout, batch_size, self.rpc_deadline, data_order))
        why = disagreement([s.label for s in self.shards], [i.settings for i in infos])
        if why:
            self.leave_on_stop()               # free the rank at once: nothing was trained
            raise ConfigError(why)
        self._keep_sessions()
        for s in self.shards:
            s.on_register = self._keep_sessions     # a rejoin gets a new credential: keep it too
        taken = sum(i.took_over for i in infos)
        if taken:
            self.tell_first_push = "after the takeover"
            print(f"worker {self.rank}: took its rank back at once on {taken} of {len(infos)} shard(s) with "
                  f"the session kept in {self.session_file.path} (the previous process's gradient for "
                  f"the open step is discarded; this one trains that batch again)", flush=True)
        if self.compression.name != "none" and self.feedback is None:
            self.feedback = compress.ErrorFeedback(self.compression, infos[0].total_params)
        if self._heartbeat is None:
            self._heartbeat = threading.Thread(target=self._beat, name="ps-heartbeat", daemon=True)
            self._heartbeat.start()
        return infos

    def _keep_sessions(self) -> None:
        with self._file_lock:
            self.session_file.save([(s.address, s.info.instance if s.info else "", s.session)
                                    for s in self.shards])

    def _beat(self) -> None:
        """Keep this worker's sessions live while it computes or evaluates: a shard expires a
        session that made no call for its --step-timeout. Errors are the main calls' to report."""
        while not self._stop.wait(min(5.0, max(0.05, min(s.session_timeout for s in self.shards) / 4))):
            for s in self.shards:
                if self._stop.is_set():          # close() waits for this thread, then closes
                    return                       # the channels: no beat starts on a closed one
                try:
                    s.heartbeat(self.rank, timeout=HEARTBEAT_TIMEOUT_S)
                except PServerError:
                    pass

    def plane_description(self) -> str:
        fast = sum(s.fast is not None for s in self.shards)
        plane = ("payloads over gRPC streams" if fast == 0 else "payloads through shared memory"
                 if fast == len(self.shards) else f"shared memory with {fast} of {len(self.shards)}")
        if self.feedback is not None:
            told = "; pushes go over gRPC: shared memory carries float32 only" if fast else ""
            plane += f"; pushes compressed {self.compression} with error feedback{told}"
        if self.pull_compression != "none":
            how = ("pulls over shared memory stay float32" if fast == len(self.shards)
                   else "gRPC pulls in bf16")
            plane += f"; {how}"
        return plane

    def init(self, flat: np.ndarray) -> list[bool]:
        return self.each(lambda s: s.init(self.rank, flat, self.rpc_deadline))

    def pull(self, flat: np.ndarray, clock: int = 0, seen: Sequence[int] | None = None) -> list[int]:
        """Pull every shard's range into `flat` (waiting as the mode says); returns versions."""
        seen = self.versions if seen is None else seen
        replies = self.each(lambda s: s.pull_into(flat, self.rank, seen[s.index], clock,
                                                  self.rpc_deadline))
        self.versions = [v for v, _ in replies]
        self.finished |= any(f for _, f in replies)
        return self.versions

    def owners(self, lookups: Sequence[sparse.TableLookup]) -> list[list[np.ndarray | slice]]:
        """For each lookup, for each shard: the positions in lookup.uniq of the ids it holds
        (with one shard, a slice of all of them: no gather, no scatter). Lookups that share
        their ids (tables fed the same ids) share the answer, and the same ids asked again
        (a step's push after its row pull) get the answer kept from the last call."""
        n = len(self.shards)
        if n == 1:
            return [[slice(None)] for _ in lookups]
        keys, kept = [lk.uniq for lk in lookups], self._owned
        if len(keys) == len(kept[0]) and all(a is b for a, b in zip(keys, kept[0])):
            return kept[1]
        out, done = [], {}
        for lk in lookups:
            if id(lk.uniq) not in done:
                done[id(lk.uniq)] = self._split_by_owner(sparse.shard_of(lk.uniq, n), n)
            out.append(done[id(lk.uniq)])
        self._owned = (keys, out)
        return out

    @staticmethod
    def _split_by_owner(owner: np.ndarray, n: int) -> list[np.ndarray]:
        if n <= 16:        # a pass per shard beats a sort (n log n) of 64k owners
            return [np.flatnonzero(owner == j) for j in range(n)]
        order = np.argsort(owner, kind="stable")
        return np.split(order, np.searchsorted(owner[order], np.arange(1, n)))

    def pull_rows(self, lookups: Sequence[sparse.TableLookup], tables: Sequence[str]) -> None:
        """Fill each lookup's rows from the shards that hold them (all shards in parallel)."""
        owners = self.owners(lookups)

        def pull(s: ShardClient) -> None:
            for lk, name, where in zip(lookups, tables, owners):
                idx = where[s.index]
                ids = lk.uniq[idx]
                if ids.size:
                    whole = isinstance(idx, slice)
                    rows = lk.rows if whole else np.empty((ids.size, lk.rows.shape[1]), dtype=np.float32)
                    s.pull_rows(self.rank, name, ids, rows, self.rpc_deadline)
                    if not whole:
                        lk.rows[idx] = rows
        self.each(pull)

    def push(self, grad: np.ndarray, num_samples: int, clock: int = 0,
             steps: Sequence[int] | None = None, lookups: Sequence[sparse.TableLookup] = (),
             tables: Sequence[str] = (), lease: tuple[int, int, int] | None = None,
             trained: tuple = (0.0, 0.0, ())) -> list[tuple[str, int]]:
        """Push each shard its slice of `grad`, and the gradients of the sparse rows it holds
        (each lookup's grads, already summed per unique id), computed on `steps` (default:
        last pulled); returns (outcome, version) per shard. `lease`: (epoch, chunk, batch) of
        the data lease the push to shard 0 carries (its coordinator's progress), with `trained`
        (the batch's loss x samples, its samples classed right, and the compiled metrics' sums:
        shard 0 sums them per epoch)."""
        steps = self.versions if steps is None else steps
        rows = self._rows(lookups, tables)
        at = _lease_at(lease, trained)
        replies = self.each(lambda s: s.push(grad, self.rank, steps[s.index], num_samples, clock,
                                             self.rpc_deadline, rows[s.index], self._packed(grad, s),
                                             at if s.index == 0 else None))
        self.finished |= any(f for _, _, f in replies)
        self._first_push_done()
        return [(o, v) for o, v, _ in replies]

    def push_pull(self, grad: np.ndarray, flat: np.ndarray, num_samples: int, clock: int = 0,
                  lookups: Sequence[sparse.TableLookup] = (), tables: Sequence[str] = (),
                  lease: tuple[int, int, int] | None = None,
                  trained: tuple = (0.0, 0.0, ())) -> list[str]:
        """A worker's step on the shards: push (as push, computed on the versions last
        pulled, `lease` and `trained` too), then pull into `flat` with clock + 1 (as pull); the
        outcome per shard. Over the data plane each shard answers both in one exchange. A
        refused push raises, and then nothing is known to be pulled: pull again."""
        rows = self._rows(lookups, tables)
        seen = self.versions
        at = _lease_at(lease, trained)
        packed = [self._packed(grad, s) for s in self.shards]
        args = [(grad, flat, self.rank, seen[s.index], num_samples, clock, seen[s.index], clock + 1,
                 self.rpc_deadline, rows[s.index], packed[s.index], at if s.index == 0 else None)
                for s in self.shards]
        if all(s.sends_ahead(rows[s.index], packed[s.index]) for s in self.shards):
            replies = self._taken([s.push_pull_sent(*args[s.index]) for s in self.shards])
        else:
            replies = self.each(lambda s: s.push_pull(*args[s.index]))
        self.versions = [v for _, v, _ in replies]
        self.finished |= any(f for _, _, f in replies)
        self._first_push_done()
        return [o for o, _, _ in replies]

    def _first_push_done(self) -> None:
        """After a takeover or a join, say once how long the process took to its first push taken in."""
        if self.tell_first_push:
            age = process_age()
            when = f" {age:.1f} s after this process started" if age is not None else ""
            print(f"worker {self.rank}: first push {self.tell_first_push} taken in{when}", flush=True)
            self.tell_first_push = ""

    def _rows(self, lookups: Sequence[sparse.TableLookup], tables: Sequence[str]) -> list[list]:
        """Per shard: (table, unique ids it holds, their gradients) for each lookup."""
        owners = self.owners(lookups)
        return [[(name, lk.uniq[w[j]], lk.grads[w[j]]) for lk, name, w in zip(lookups, tables, owners)]
                for j in range(len(self.shards))]

    def _packed(self, grad: np.ndarray, s: ShardClient) -> codecs.Packed | None:
        """Shard s's slice of grad compressed, residual added and kept (None: --compress none)."""
        if self.feedback is None:
            return None
        return self.feedback.pack(grad, s.info.range_start, s.info.range_end)

    def lease_data(self, num_batches: int, chunk_batches: int, seed: int, fingerprint: str, epochs: int = 0,
                   in_order: bool = False, finished: tuple[int, int] | None = None, restart: bool = False,
                   done_before_restore=()) -> pb.LeaseDataReply:
        """This worker's lease of the training data from shard 0's coordinator (LeaseData); `in_order`:
        --no-shuffle; `restart`: start a finished coordinator over (--no-resume); `done_before_restore`:
        (epoch, chunk, end) it trained under a coordinator shard 0 has since restored over (the reply's
        coordinator_id changed)."""
        done = [pb.LeaseDoneBeforeRestore(epoch=e, chunk=c, end=n) for e, c, n in done_before_restore]
        request = pb.LeaseDataRequest(rank=self.rank, num_batches=num_batches, chunk_batches=chunk_batches,
                                      seed=seed, fingerprint=fingerprint, epochs=epochs, in_order=in_order,
                                      finished=finished is not None, restart=restart,
                                      done_before_restore=done)
        if finished is not None:
            request.finished_epoch, request.finished_chunk = finished
        return self.shards[0].lease_data(request, self.rpc_deadline)

    def epoch_logs(self, epoch: int, share: tuple[dict, bool] | None = None) -> pb.LeaseDataReply:
        """Keras on a cluster: the chief gives its logs of `epoch` and its stop decision (`share`:
        (logs, stop)); another worker asks for them (reply.has_logs once given)."""
        request = pb.LeaseDataRequest(rank=self.rank, epoch_logs=True, logs_epoch=epoch,
                                      share_logs=share is not None)
        if share is not None:
            logs, stop = share
            request.log_names.extend(logs)
            request.log_values.extend(float(v) for v in logs.values())
            request.stop_training = bool(stop)
        return self.shards[0].lease_data(request, self.rpc_deadline)

    def status(self, timeout: float = 10.0) -> list[pb.StatusReply]:
        return self.each(lambda s: s.status(timeout))

    def leave(self) -> None:
        self._stop.set()
        self.each(lambda s: s.leave(self.rank, 10.0))
        self.session_file.remove({s.address: s.session for s in self.shards})

    def leave_on_stop(self, timeout: float = LEAVE_ON_STOP_S) -> None:
        """Leave every shard on the way out of a stopped run, so that no step waits
        --step-timeout for us. From this thread, one shard after another: the pool's threads
        may be parked in a pull. Errors are ignored: the worker exits either way."""
        self._stop.set()
        for s in self.shards:
            if s.session:
                try:
                    s.leave(self.rank, timeout)
                except PServerError:
                    pass
        self.session_file.remove({s.address: s.session for s in self.shards})

    def checkpoint(self) -> list[tuple[str, int]]:
        """Ask every shard to write a checkpoint now; ("", version) where it keeps none."""
        return self.each(lambda s: s.checkpoint(self.rank, self.rpc_deadline))

    def set_lr(self, lr: float) -> list[int]:
        """The chief's new base learning rate on every shard, between two of its steps (so every
        shard takes it at the same step in sync); each shard's version it follows."""
        return self.each(lambda s: s.set_lr(self.rank, lr, self.rpc_deadline))

    def assign(self, flat: np.ndarray) -> list[int]:
        """The chief's weights on every shard, each fenced on its version now (status): the
        versions after. Every other worker must have left (Shard.assign)."""
        expected = {st.shard: st.version for st in self.status()}
        return self.each(lambda s: s.assign(self.rank, flat, expected[s.index], self.rpc_deadline))

    def export_table(self, table: str, timeout: float = 600.0):
        """Every row of `table` on every shard: ([each shard's version], total rows, pages of
        ascending ids and their rows, the shards' streams merged as they are read)."""
        from pserver.persist.model_file import merge_pages
        streams = [s.export_rows(self.rank, table, timeout) for s in self.shards]
        return ([v for v, _, _ in streams], sum(n for _, n, _ in streams),
                merge_pages([p for _, _, p in streams]))

    def stop_shards(self) -> list[tuple[str, int]]:
        """The chief's last call: every shard checkpoints, then exits 0 (--stop-shards)."""
        return self.each(lambda s: s.checkpoint(self.rank, self.rpc_deadline, then_stop=True))

    def close(self) -> None:
        """Stop the heartbeat (a beat in flight ends within HEARTBEAT_TIMEOUT_S), then close the
        channels and the shared-memory planes."""
        self._stop.set()
        if self._heartbeat is not None and self._heartbeat is not threading.current_thread():
            self._heartbeat.join(HEARTBEAT_TIMEOUT_S + 1.0)
        for s in self.shards:
            s.close()
        if self._pool is not None:
            self._pool.shutdown(wait=False)
