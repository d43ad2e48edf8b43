"""One exception tree for everything pserver raises on purpose.

    PServerError                 base: a message a user can act on, never a traceback
     +-- ConfigError             bad flag, bad TF_CONFIG, bad combination of options
     +-- DataError               dataset missing, unreadable or malformed
     +-- RpcError                something a shard answered (or failed to answer)
          +-- InvalidArgument    shape, dtype, size, non-finite values, unknown tensor
          +-- FailedPrecondition wrong step, unknown worker, layout mismatch
          +-- Unauthenticated    missing or wrong token, or another worker's session
          +-- AlreadyExists      Register for a rank whose session is still live
          +-- ResourceExhausted  a bound on parked pulls, streams, bytes or memory
          +-- Unavailable        shard down or unreachable
          +-- DeadlineExceeded   a wait ran past its deadline

`grpc.RpcError` is translated into this tree once, in `pserver.worker.client`; the server
raises the RpcError subclasses and the servicer turns them into status codes.

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


class DataError(PServerError):
    """A dataset that is missing, unreadable or malformed."""


class RpcError(PServerError):
    """An error that crosses the wire; `code_name` is the grpc.StatusCode name."""

    code_name = "UNKNOWN"


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


class ProcessFailed(PServerError):
    """A process of the cluster (launch's child, a Ray actor) exited with `code`: the
    launcher exits transient when it did (or when a signal killed it), else failed."""

    def __init__(self, role: str, code: int, what: str = "; stopping the cluster") -> None:
        if code < 0:                   # Popen: killed by signal -code
            code = 128 - code
        super().__init__(f"{role} exited with code {code}{what}")
        self.exit_code = EXIT_TRANSIENT if code >= 128 else EXIT_FAILED


RPC_ERRORS = {cls.code_name: cls for cls in
              (InvalidArgument, FailedPrecondition, Unauthenticated, AlreadyExists, ResourceExhausted,
               Unavailable, DeadlineExceeded)}


def rpc_error_for(code_name: str, message: str) -> RpcError:
    """The RpcError subclass for a grpc status code name (RpcError itself if unknown)."""
    err = RPC_ERRORS.get(code_name, RpcError)(message)
    if type(err) is RpcError:
        err.code_name = code_name
    return err
