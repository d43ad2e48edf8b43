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

`grpc.RpcError` is translated into this tree once, in `pserver.client`; the server
raises the RpcError subclasses and the servicer turns them into status codes.
"""

from __future__ import annotations


class PServerError(Exception):
    """Base of every error pserver raises for a reason it can explain."""


class ConfigError(PServerError):
    """A flag, TF_CONFIG or option combination that cannot work."""


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


class Unavailable(RpcError):
    code_name = "UNAVAILABLE"


class DeadlineExceeded(RpcError):
    code_name = "DEADLINE_EXCEEDED"


RPC_ERRORS = {cls.code_name: cls for cls in
              (InvalidArgument, FailedPrecondition, Unauthenticated, AlreadyExists, ResourceExhausted,
               Unavailable, DeadlineExceeded)}


def rpc_error_for(code_name: str, message: str) -> RpcError:
    """The RpcError subclass for a grpc status code name (RpcError itself if unknown)."""
    err = RPC_ERRORS.get(code_name, RpcError)(message)
    if type(err) is RpcError:
        err.code_name = code_name
    return err
