"""One record per message, shared by the shard and the worker, with its one converter to and
from the protobuf message.

`Registration` is what a shard answers a Register with: `Shard.register` returns it, the
servicer sends it as a RegisterReply (registration_reply), and the worker's client reads the
reply back into the same record (registration_of), kept per shard as `ShardClient.info`.

`PushRequest` is one push as a shard receives it: the servicer (from the stream's header) and
the data plane (from its request frame) each build it once, and it goes unchanged through
`Shard.push` to the consistency mode's policy.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any, Sequence

from pserver._proto import pserver_pb2 as pb
from pserver.observe.status import settings_of
from pserver.wire.codec import PROTOCOL_VERSION, Position

if TYPE_CHECKING:
    from pserver.sparse import RowGrads


@dataclass(frozen=True)
class Registration:
    """A shard's answer to Register (pb.RegisterReply, field for field)."""
    mode: str
    version: int
    initialized: bool
    range_start: int                  # this shard's range of the flat parameter vector
    range_end: int
    total_params: int
    layout_signature: str
    optimizer: str
    lr: float
    dataplane: str                    # the data plane's address ("" without one)
    host_id: str
    session: str                      # the rank's credential for every later call
    session_timeout_seconds: float
    protocol_version: int = PROTOCOL_VERSION
    restored_from: str = ""           # the checkpoint the shard resumed from at start
    seeded_by_rank: int = -1          # the rank whose Init supplied the values, -1 if none
    position: Position | None = None  # the rank's recorded position; None when there is none
    settings: dict | None = None      # ServerConfig.training_settings: compared across shards
    instance: str = ""                # the shard process's random id
    took_over: bool = False           # the Register took the rank's live session over
    assigned_rank: int = 0            # the rank registered (assigned by shard 0 for --rank auto)
    elastic_initial_workers: int = 0  # ranks below: members from the start; above: join from a step
    elastic_max_workers: int = 0      # --max-workers


@dataclass(frozen=True, slots=True)
class PushRequest:
    """One push to a shard: who sent it, for which step, and where its gradient comes from."""
    rank: int
    shard: int
    step: int                         # the version the gradient was computed on
    num_elements: int                 # the dense gradient's size, checked against the shard's
    dtype: str
    num_samples: int                  # the samples behind the gradient (the step's mean weighs by them)
    clock: int                        # the worker's own step count (ssp bounds staleness by it)
    fill: Any                         # fills the dense gradient: a callable, an array, or the
                                      # data plane's Parts (ShardStore.fill)
    session: str | None = None        # the rank's credential (None: not checked, in-process)
    rows: Sequence[RowGrads] = ()     # the sparse parts, in Shard.row_buffers' arrays
    lease: tuple[int, int, int] | None = None   # (epoch, chunk, batch) of shard 0's lease this push
                                      # carries (the batches before it are done); None: no lease
    trained: tuple = (0.0, 0.0, ())   # with a lease: the batch's loss x samples, and its
                                      # samples classed right, the compiled metrics' sums (shard
                                      # 0 sums them per epoch)
    statistics: Any = ()              # the slots of the mean elements another shard holds, whose
                                      # variance this shard does (pserver.server.statistics.away_means)


def registration_reply(reg: Registration) -> pb.RegisterReply:
    fields = asdict(reg) | {"settings": pb.TrainingSettings(**(reg.settings or {}))}
    position = fields.pop("position")
    return pb.RegisterReply(**fields,
                            position=pb.TrainingPosition(**position._asdict()) if position else None)


def registration_of(reply: pb.RegisterReply) -> Registration:
    fields = {name: getattr(reply, name) for name in Registration.__dataclass_fields__}
    return Registration(**fields | {"position": Position.of(reply), "settings": settings_of(reply.settings)})
