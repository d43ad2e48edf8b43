"""The gRPC servicer: decode, call the Shard, encode. No arithmetic, no mode logic.

Every pserver error becomes its status code with its message, and an error kind's wire name
(pserver.errors.KINDS) goes with it as trailing metadata; anything else is a bug and becomes
INTERNAL with the exception's text (the server keeps serving).
"""

from __future__ import annotations

import functools
import logging

import grpc
import numpy as np

from pserver._proto import pserver_pb2 as pb
from pserver._proto import pserver_pb2_grpc as pb_grpc
from pserver.errors import KIND_METADATA, InvalidArgument, RpcError
from pserver.models.layout import Layout
from pserver.records import PushRequest, registration_reply
from pserver.server import checks, compress
from pserver.server.shard import Shard
from pserver.wire import codec

log = logging.getLogger("pserver.server")
MAX_WAIT = 3600.0   # a pull with no deadline still stops waiting after an hour


def _abort(context, e: Exception, name: str):
    """A pserver error becomes its status code (its kind, if it has one, in the trailing
    metadata); anything else is a bug, reported as INTERNAL while the server keeps serving.
    grpc's own abort exceptions pass through."""
    if isinstance(e, RpcError):
        if e.kind:
            context.set_trailing_metadata(((KIND_METADATA, e.kind),))
        context.abort(getattr(grpc.StatusCode, e.code_name, grpc.StatusCode.UNKNOWN), str(e))
    if isinstance(e, grpc.RpcError) or type(e).__name__ == "_AbortError":
        raise e
    log.exception("internal error in %s", name)
    context.abort(grpc.StatusCode.INTERNAL, f"{type(e).__name__}: {e}")


def _status(method):
    """Translate exceptions raised by a handler into gRPC status codes, in one place."""
    @functools.wraps(method)
    def wrapper(self, request, context):
        try:
            return method(self, request, context)
        except Exception as e:
            _abort(context, e, method.__name__)
    return wrapper


def _stream_status(method):
    """As _status, for handlers that yield a response stream."""
    @functools.wraps(method)
    def wrapper(self, request, context):
        try:
            yield from method(self, request, context)
        except Exception as e:
            _abort(context, e, method.__name__)
    return wrapper


def _timeout(context) -> float:
    left = context.time_remaining()
    return MAX_WAIT if left is None else max(0.0, min(left - 0.05, MAX_WAIT))


def add_to_server(servicer: "ParameterServerServicer", server: grpc.Server) -> None:
    """Register every rpc of the service. As the generated add_..._to_server, except that
    the tensor streams (Init, AssignWeights, Push, Pull) use the codec's TensorChunk encoding."""
    unary = {"Register": (pb.RegisterRequest, pb.RegisterReply), "Status": (pb.StatusRequest, pb.StatusReply),
             "Leave": (pb.LeaveRequest, pb.LeaveReply),
             "Checkpoint": (pb.CheckpointRequest, pb.CheckpointReply),
             "Heartbeat": (pb.HeartbeatRequest, pb.HeartbeatReply),
             "ElasticJoinStep": (pb.ElasticJoinStepRequest, pb.ElasticJoinStepReply),
             "LeaseData": (pb.LeaseDataRequest, pb.LeaseDataReply),
             "SetLearningRate": (pb.SetLearningRateRequest, pb.SetLearningRateReply)}
    handlers = {name: grpc.unary_unary_rpc_method_handler(
        getattr(servicer, name), request_deserializer=req.FromString,
        response_serializer=rep.SerializeToString) for name, (req, rep) in unary.items()}
    handlers["Init"] = grpc.stream_unary_rpc_method_handler(
        servicer.Init, request_deserializer=codec.parse_chunk,
        response_serializer=pb.InitReply.SerializeToString)
    handlers["AssignWeights"] = grpc.stream_unary_rpc_method_handler(
        servicer.AssignWeights, request_deserializer=codec.parse_chunk,
        response_serializer=pb.AssignWeightsReply.SerializeToString)
    handlers["Push"] = grpc.stream_unary_rpc_method_handler(
        servicer.Push, request_deserializer=codec.parse_chunk,
        response_serializer=pb.PushReply.SerializeToString)
    handlers["Pull"] = grpc.unary_stream_rpc_method_handler(
        servicer.Pull, request_deserializer=pb.PullRequest.FromString,
        response_serializer=codec.serialize_chunk)
    handlers["PullRows"] = grpc.unary_stream_rpc_method_handler(
        servicer.PullRows, request_deserializer=pb.PullRowsRequest.FromString,
        response_serializer=codec.serialize_chunk)
    handlers["ExportRows"] = grpc.unary_stream_rpc_method_handler(
        servicer.ExportRows, request_deserializer=pb.ExportRowsRequest.FromString,
        response_serializer=pb.ExportRowsPage.SerializeToString)
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler("pserver.v1.ParameterServer", handlers),))


class ParameterServerServicer(pb_grpc.ParameterServerServicer):
    def __init__(self, shard: Shard) -> None:
        self.shard = shard

    @_status
    def Register(self, request, context):
        layout = Layout.of(((t.name, tuple(t.shape)) for t in request.layout),
                           [codec.table_config(t) for t in request.tables])
        layout = layout.freezing(t.name for t in request.layout if t.frozen).with_statistics(
            {t.name: t.momentum for t in request.layout if t.HasField("momentum")})
        reg = self.shard.register(request.rank, request.num_workers, request.shard,
                                  request.num_shards, layout, request.protocol_version,
                                  request.data_seed, request.steps_per_epoch, request.previous_session,
                                  request.elastic_auto_rank)
        return registration_reply(reg)

    @_status
    def ElasticJoinStep(self, request, context):
        version, member_from = self.shard.join_step(request.rank, request.step, request.session)
        return pb.ElasticJoinStepReply(version=version, member_from=member_from)

    def _stream(self, request_iterator, context, call, push: bool = False):
        """A push or init stream within the shard's bounds (server/limits.py): counted from
        its first message, cancelled when it stalls, at most 2 in flight per rank. A push's
        sparse rows follow its dense slice in the same stream, into arrays sized (and
        bounded) from its header before any of them is received."""
        limits = self.shard.limits
        with limits.stream(context.cancel, self.shard.payload_bytes) as stream:
            h, chunks = codec.read_header(limits.progress(stream, request_iterator))
            with limits.stream_rank(h.rank):
                checks.only_push_carries(h.sparse, h.compression, push)
                rows = self.shard.row_buffers([(p.table, p.num_ids) for p in h.sparse])
                more = [a for r in rows for a in (r.ids, r.grads)]
                return call(h, rows, compress.fill_for(h, chunks, more))

    @_status
    def Init(self, request_iterator, context):
        already, version = self._stream(request_iterator, context, lambda h, rows, fill: self.shard.init(
            h.rank, h.layout_signature, h.num_elements, h.dtype, fill, session=h.session))
        return pb.InitReply(already_initialized=already, version=version)

    @_status
    def AssignWeights(self, request_iterator, context):
        version = self._stream(request_iterator, context, lambda h, rows, fill: self.shard.assign(
            h.rank, h.step, h.num_elements, h.dtype, fill, session=h.session))
        return pb.AssignWeightsReply(version=version)

    @_stream_status
    def Pull(self, request, context):
        compress.check_pull(request.compression)
        version, params, finished = self.shard.pull(request.rank, request.shard, request.seen_version,
                                                    request.clock, _timeout(context),
                                                    session=request.session, alive=context.is_active)
        header = pb.TensorHeader(shard=request.shard, step=version, finished=finished,
                                 compression=request.compression)
        chunk_bytes = self.shard.cfg.chunk_bytes
        yield from codec.encode_parts(header, compress.pull_payload(params, request.compression, chunk_bytes),
                                      chunk_bytes, params.size)

    @_status
    def Push(self, request_iterator, context):
        outcome, version, message, finished = self._stream(request_iterator, context, self._push, push=True)
        return pb.PushReply(outcome=outcome.value, version=version, message=message,
                            finished=finished)

    @_stream_status
    def PullRows(self, request, context):
        if len(request.ids) % 8:
            raise InvalidArgument(f"ids: {len(request.ids)} bytes is not a whole number of uint64 ids")
        ids = np.frombuffer(request.ids, dtype="<u8")
        version, rows = self.shard.pull_rows(request.rank, request.shard, request.table, ids,
                                             session=request.session)
        header = pb.TensorHeader(shard=request.shard, step=version)
        yield from codec.encode(header, rows, self.shard.cfg.chunk_bytes)

    @_stream_status
    def ExportRows(self, request, context):
        version, total, pages = self.shard.export_rows(request.rank, request.shard, request.table,
                                                       session=request.session)
        for ids, rows in pages:
            yield pb.ExportRowsPage(version=version, total_rows=total, dim=rows.shape[1],
                                    dtype=rows.dtype.name,
                                    ids=ids.astype("<u8", copy=False).tobytes(),
                                    rows=rows.astype(rows.dtype.newbyteorder("<"), copy=False).tobytes())

    def _push(self, h, rows, fill):
        lease = (h.lease_epoch, h.lease_chunk, h.lease_batch) if h.has_lease else None
        return self.shard.push(PushRequest(h.rank, h.shard, h.step, h.num_elements, h.dtype, h.num_samples,
                                           h.clock, fill, session=h.session, rows=rows, lease=lease,
                                           trained=(h.lease_loss_sum, h.lease_correct,
                                                    tuple(h.lease_metric_sums)),
                                           statistics=np.asarray(h.statistics, np.float32)))

    @_status
    def LeaseData(self, request, context):
        return self.shard.answer_lease(request)

    @_status
    def Heartbeat(self, request, context):
        return pb.HeartbeatReply(version=self.shard.heartbeat(request.rank, request.session))

    @_status
    def Status(self, request, context):
        st = self.shard.status()
        return pb.StatusReply(counters=pb.Counters(**st.pop("counters")),
                              tables=[pb.TableStatus(**t) for t in st.pop("tables")],
                              settings=pb.TrainingSettings(**st.pop("settings")),
                              memory=pb.MemoryStatus(**st.pop("memory")), **st)

    @_status
    def Checkpoint(self, request, context):
        with self.shard.limits.checkpoint_call():
            ask = self.shard.stop_after_checkpoint if request.then_stop else self.shard.checkpoint
            path, version = ask(request.rank, request.session)
        return pb.CheckpointReply(path=path, version=version)

    @_status
    def SetLearningRate(self, request, context):
        version, before = self.shard.set_lr(request.rank, request.session, request.lr)
        return pb.SetLearningRateReply(version=version, lr=before)

    @_status
    def Leave(self, request, context):
        self.shard.leave(request.rank, request.session)
        return pb.LeaveReply()
