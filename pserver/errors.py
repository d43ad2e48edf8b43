"""One exception tree for everything pserver raises on purpose.

    PServerError                 base: a message a user can act on, never a traceback
     +-- ConfigError             bad flag, bad TF_CONFIG, bad combination of options
     |    +-- NotInKeras         a Keras name pserver.keras lacks (also an AttributeError)
     +-- DataError               dataset missing, unreadable or malformed
     |    +-- ModelFileError     a model file naming an unknown optimizer or layer, or malformed
     |    |    +-- UnsafeModelFile  a model file that would run code, loaded with safe_mode=True
     |    +-- Pruned             a delta its exporter removed while a server read it (skipped)
     +-- ProcessFailed           a process of the cluster (launch's child, a Ray actor) exited
     +-- RpcError                something a shard answered (or failed to answer)
          +-- InvalidArgument    shape, dtype, size, non-finite values, unknown tensor
          +-- FailedPrecondition wrong step, unknown worker, layout mismatch
          |    +-- StaleStep          a push for a step the shard does not take now: pull again
          |    |    +-- AlreadyPushed this rank's push for the step is already held
          |    +-- JoinStepOpen       a joining worker proposed a step the shard already opened
          |    +-- LeaseGone          a push for a data lease this worker no longer holds
          |    +-- NotRegistered      the rank (or every worker) has not registered with the shard
          |    +-- SeenVersionAhead   a pull that saw a version the shard does not have
          +-- Unauthenticated    missing or wrong token, or another worker's session
          |    +-- TakenOver          the rank's session was taken over by a restarted process
          +-- AlreadyExists      Register for a rank whose session is still live
          +-- ResourceExhausted  a bound on parked pulls, streams, bytes or memory
          |    +-- OverBudget         a push no wait can make fit (--max-memory-mb, --max-inflight-mb)
          +-- Unavailable        shard down or unreachable
          +-- DeadlineExceeded   a wait ran past its deadline

`grpc.RpcError` is translated into this tree where gRPC raises it: on a worker in
`pserver.worker.client` (ShardClient.call: a shard's refusal or silence), on a shard in
`pserver.wire.security` (a request stream cut off mid-read); the server raises the RpcError
subclasses and the servicer turns them into status codes.

The subclasses below the status codes' classes are error kinds: the callers that recover
from one (a worker rejoins a shard that forgot it, pulls again after a stale step) catch its
class, never match its text. Each has a stable wire name, `kind`, which a refusal carries
beside its status code and unchanged message: as gRPC trailing metadata KIND_METADATA, and
on the data plane as its position in KINDS (pserver.wire.frames). A peer that sends no kind
(an older release) or one this release does not know gives the status code's class.

Each error carries the exit code of the process it ends, after Kubeflow's ExitCode restart
policy: 1-127 for what a restart cannot fix (retrying is pointless), >= 128 for what it may
(the policy restarts those): 138 for a transient failure, 128+N for signal N (pserver.signals).
docs/semantics.md, "Errors and exit codes", lists them.
"""

from __future__ import annotations

EXIT_FAILED = 1        # a failure a restart cannot fix: refused request, unreadable data or model
EXIT_USAGE = 2         # a user's mistake found before anything ran: flag, TF_CONFIG, file
# A failure a restart may fix (a shard unreachable or busy past the deadline): 128 + SIGUSR1,
# the code Kubeflow's operator has reserved for a user's retryable error since its ExitCode
# policy began (later releases retry every code >= 128; both retry this one).
EXIT_TRANSIENT = 138


class PServerError(Exception):
    """Base of every error pserver raises for a reason it can explain."""

    exit_code = EXIT_FAILED


class ConfigError(PServerError):
    """A flag, TF_CONFIG or option combination that cannot work."""

    exit_code = EXIT_USAGE


class NotInKeras(ConfigError, AttributeError):
    """A Keras name pserver.keras does not have (keras.layers.BatchNormalization, ...): one line
    naming it and pointing at the table of what is supported. An AttributeError too, so that
    hasattr() and getattr(..., default) work as on any module."""


class DataError(PServerError):
    """A dataset that is missing, unreadable or malformed."""


class Pruned(DataError):
    """A delta removed by its exporter (export --keep-deltas) while a server read it: skipped,
    not counted as refused (pserver.serving.model)."""


class ModelFileError(DataError):
    """A model file (model.save, --save, pserver export) whose contents cannot be the model it
    claims: an unknown optimizer or layer name, a config that does not build, a malformed field.
    The message names the file and what is wrong."""


class UnsafeModelFile(ModelFileError):
    """A model file that would run code to be loaded (it names a Python module or file whose
    function builds the model), loaded with safe_mode=True (the default): a file from elsewhere
    runs no code unless the caller passes safe_mode=False."""


class RpcError(PServerError):
    """An error that crosses the wire; `code_name` is the grpc.StatusCode name, `kind` the
    error kind's wire name ("" for the status codes' own classes)."""

    code_name = "UNKNOWN"
    kind = ""


class InvalidArgument(RpcError):
    code_name = "INVALID_ARGUMENT"


class FailedPrecondition(RpcError):
    code_name = "FAILED_PRECONDITION"


class Unauthenticated(RpcError):
    code_name = "UNAUTHENTICATED"


class AlreadyExists(RpcError):
    code_name = "ALREADY_EXISTS"


class ResourceExhausted(RpcError):
    code_name = "RESOURCE_EXHAUSTED"
    exit_code = EXIT_TRANSIENT         # a bound of a busy shard: it frees up


class Unavailable(RpcError):
    code_name = "UNAVAILABLE"
    exit_code = EXIT_TRANSIENT         # a shard down or unreachable: it may come back


class DeadlineExceeded(RpcError):
    code_name = "DEADLINE_EXCEEDED"
    exit_code = EXIT_TRANSIENT


# --- error kinds: what a caller tells apart (by class) ------------------------------------
class StaleStep(FailedPrecondition):
    """A push for a step (version) the shard does not take now: the worker pulls what the
    shard has and computes again."""
    kind = "stale_step"


class AlreadyPushed(StaleStep):
    """This rank's push for the open step is already held (a push retried after its reply
    was lost): as a stale step, pull and go on."""
    kind = "already_pushed"


class JoinStepOpen(FailedPrecondition):
    """An elastic worker proposed to join from a step this shard has already opened (a step's
    members are fixed when it opens): the worker proposes a later step."""
    kind = "join_step_open"


class LeaseGone(FailedPrecondition):
    """A push carried a batch of a data lease this worker no longer holds (its session was
    marked dead, e.g. stopped past --step-timeout, and the chunk went to another worker):
    shard 0 refuses it; the worker drops the chunk and asks for another."""
    kind = "lease_gone"


class NotRegistered(FailedPrecondition):
    """The rank has not registered with this shard, or no worker has (a restarted shard):
    the worker registers again."""
    kind = "not_registered"


class SeenVersionAhead(FailedPrecondition):
    """A pull that saw a version the shard does not have (restored from an older
    checkpoint): the worker pulls what the shard has."""
    kind = "seen_version_ahead"


class TakenOver(Unauthenticated):
    """The rank's session was taken over by a restarted process of the same worker: this
    process must stop."""
    kind = "taken_over"


class OverBudget(ResourceExhausted):
    """A push that no wait can make fit: its new sparse rows exceed the shard's --max-memory-mb
    with no row that may be evicted, or its rows alone exceed what one push may carry
    (--max-inflight-mb). Not retried, and a restart cannot fix it either, so the worker stops
    with the shard's line."""
    kind = "over_budget"
    exit_code = EXIT_FAILED


class ProcessFailed(PServerError):
    """A process of the cluster (launch's child, a Ray actor) exited with `code`: the
    launcher exits transient when it did (or when a signal killed it), 2 when the child found a
    mistake of the user's (so that a scheduler does not start it again unchanged), else failed."""

    def __init__(self, role: str, code: int, what: str = "; stopping the cluster") -> None:
        if code < 0:                   # Popen: killed by signal -code
            code = 128 - code
        super().__init__(f"{role} exited with code {code}{what}")
        self.exit_code = EXIT_TRANSIENT if code >= 128 else EXIT_USAGE if code == EXIT_USAGE else EXIT_FAILED


RPC_ERRORS = {cls.code_name: cls for cls in
              (InvalidArgument, FailedPrecondition, Unauthenticated, AlreadyExists, ResourceExhausted,
               Unavailable, DeadlineExceeded)}


# kind -> class. Append only: the data plane sends a kind as its position in this table.
KINDS = {cls.kind: cls for cls in (StaleStep, AlreadyPushed, NotRegistered, SeenVersionAhead, TakenOver,
                                   OverBudget, JoinStepOpen, LeaseGone)}
KIND_METADATA = "pserver-error-kind"   # the gRPC trailing metadata key that carries a kind


def rpc_error_for(code_name: str, message: str, kind: str = "") -> RpcError:
    """The RpcError subclass for an error kind's wire name, or (no kind, a kind this release
    does not know, or one that does not belong to the status code) for the grpc status code
    name; RpcError itself if that is unknown too."""
    cls = KINDS.get(kind)
    if cls is None or cls.code_name != code_name:
        cls = RPC_ERRORS.get(code_name, RpcError)
    err = cls(message)
    if type(err) is RpcError:
        err.code_name = code_name
    return err
