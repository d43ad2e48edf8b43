"""Who may talk to a shard, and what a shard accepts: the auth token, TLS, request decoding.

- The token (`--auth-token` or `PSERVER_AUTH_TOKEN`) travels in every call's metadata as
  `authorization: Bearer <token>`. A server interceptor checks it before any handler
  runs, so a refused call never reaches the shard and changes nothing. The comparison is
  constant-time (`hmac.compare_digest` on bytes); no message ever echoes a token. The
  same-host data plane checks the same token in its HELLO (pserver/server/dataplane.py).
- TLS: the shard serves with `--tls-cert/--tls-key`; clients trust `--tls-ca`.
- Requests are parsed inside the handler rather than by gRPC, so bytes that are not a
  valid message get INVALID_ARGUMENT naming the message, not gRPC's bare INTERNAL.
"""

from __future__ import annotations

import collections
import hmac
import os
import stat
from dataclasses import dataclass, field
from typing import Callable, Iterator

import grpc

from pserver.errors import ConfigError, InvalidArgument, rpc_error_for

TOKEN_ENV = "PSERVER_AUTH_TOKEN"
METADATA_KEY = "authorization"
SCHEME = "Bearer "
MAX_TOKEN = 4096            # characters; a metadata value far below gRPC's 8 KiB header limit
MAX_PEM = 1 << 20           # a certificate chain or key file larger than 1 MiB is not one


# --- the token ------------------------------------------------------------------------
def resolve_token(flag_value: str | None, flag: str = "--auth-token",
                  token_file: str | None = None) -> str | None:
    """The token from the flag, else from --token-file, else from PSERVER_AUTH_TOKEN (empty
    means unset), checked."""
    if flag_value is not None and token_file is not None:
        raise ConfigError(f"{flag} and --token-file: give the token one way, not both")
    if flag_value is not None:
        return check_token(flag_value, flag)
    if token_file is not None:
        return read_token_file(token_file)
    env = os.environ.get(TOKEN_ENV)
    return check_token(env, TOKEN_ENV) if env else None


def state_dir() -> str:
    """pserver's per-user state: $XDG_STATE_HOME/pserver (default ~/.local/state/pserver)."""
    base = os.environ.get("XDG_STATE_HOME") or os.path.join(os.path.expanduser("~"), ".local", "state")
    return os.path.join(base, "pserver")


def check_private(path: str, mode_bits: int, what: str, flag: str) -> None:
    """Refuse (ConfigError naming `flag`) a file or directory that is not this user's own or
    that others may read or change: ssh's rule for its keys."""
    try:
        st = os.lstat(path)
    except OSError as e:
        raise ConfigError(f"{flag}: cannot read {path} ({e.strerror or e})") from None
    kind = stat.S_ISDIR if what == "directory" else stat.S_ISREG
    if not kind(st.st_mode):
        raise ConfigError(f"{flag}: {path} is not a {what}")
    if st.st_uid != os.geteuid():
        raise ConfigError(f"{flag}: {path} belongs to user id {st.st_uid}, not to this user "
                          f"({os.geteuid()}); it must be your own")
    if stat.S_IMODE(st.st_mode) & 0o077:
        raise ConfigError(f"{flag}: {path} has mode {stat.S_IMODE(st.st_mode):04o}: others may read or "
                          f"change it; it must be {mode_bits:04o} (chmod {mode_bits:o} {path})")


def private_dir(path: str, flag: str) -> str:
    """`path` made (mode 0700) if missing, and checked private; returns it."""
    try:
        os.makedirs(path, mode=0o700, exist_ok=True)
    except OSError as e:
        raise ConfigError(f"{flag}: cannot create {path} ({e.strerror or e})") from None
    check_private(path, 0o700, "directory", flag)
    return path


def read_token_file(path: str) -> str:
    """The token in `path` (one line; a final newline is not part of it), from a file only
    this user may read."""
    check_private(path, 0o600, "file", "--token-file")
    try:
        with open(path, "rb") as f:
            raw = f.read(MAX_TOKEN + 3)
    except OSError as e:
        raise ConfigError(f"--token-file: cannot read {path} ({e.strerror or e})") from None
    text = raw.decode("ascii", errors="replace")
    return check_token(text[:-2] if text.endswith("\r\n") else text.rstrip("\n"), f"--token-file {path}")


def write_token_file(token: str, name: str) -> str:
    """Write `token` to a new file of mode 0600 in a directory of mode 0700 (under
    $XDG_RUNTIME_DIR when set, a per-user directory that goes with the session, else in
    state_dir()/tokens); returns its path."""
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    where = os.path.join(runtime, "pserver") if runtime else os.path.join(state_dir(), "tokens")
    directory = private_dir(where, "--token-file")
    path = os.path.join(directory, name)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(token + "\n")
    except OSError as e:
        raise ConfigError(f"--token-file: cannot write {path} ({e.strerror or e})") from None
    return path


def check_token(token: str, where: str) -> str:
    # Printable ASCII without spaces: what a gRPC metadata value can carry unchanged.
    # The error says what is wrong, never what the token was.
    if not 0 < len(token) <= MAX_TOKEN or not all(0x21 <= ord(c) <= 0x7E for c in token):
        raise ConfigError(f"{where}: a token must be 1 to {MAX_TOKEN} printable ASCII characters "
                          f"without spaces (the one given has {len(token)} characters)")
    return token


def token_matches(given: bytes, expected: bytes) -> bool:
    """Constant-time comparison: the time taken says nothing about how much matched."""
    return hmac.compare_digest(given, expected)


def refusal(presented: bytes | None, expected: bytes) -> str | None:
    """Why `presented` is refused (None: accepted). Never quotes either token."""
    if presented is None:
        return (f"{METADATA_KEY}: this server requires a token (--auth-token or {TOKEN_ENV}) "
                f"and the call carried none")
    if not token_matches(presented, expected):
        return f"{METADATA_KEY}: the token does not match this server's (--auth-token or {TOKEN_ENV})"
    return None


# --- files ----------------------------------------------------------------------------
def read_pem(path: str, flag: str, marker: str) -> bytes:
    """A PEM file's bytes, or one ConfigError line naming the flag and the path."""
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_PEM + 1)
    except OSError as e:
        raise ConfigError(f"{flag}: cannot read {path} ({e.strerror or e})") from None
    if len(data) > MAX_PEM or f"-----BEGIN {marker}".encode() not in data:
        raise ConfigError(f"{flag}: {path} is not a PEM file holding a {marker.lower()}")
    return data


def check_tls_files(cert: str | None, key: str | None) -> None:
    """Fail at start, in one line, on a missing half or an unreadable file."""
    if (cert is None) != (key is None):
        raise ConfigError("--tls-cert and --tls-key go together: give both or neither")
    if cert is not None:
        server_credentials(cert, key)


def server_credentials(cert: str, key: str) -> grpc.ServerCredentials:
    return grpc.ssl_server_credentials([(read_pem(key, "--tls-key", "PRIVATE KEY"),
                                         read_pem(cert, "--tls-cert", "CERTIFICATE"))])


def add_port(server: grpc.Server, address: str, cert: str | None, key: str | None) -> int:
    """Bind `address`, with TLS when a certificate is given; returns the port (0: failed)."""
    if cert is None:
        return server.add_insecure_port(address)
    return server.add_secure_port(address, server_credentials(cert, key))


# --- the server side ------------------------------------------------------------------
_HANDLERS = {(False, False): grpc.unary_unary_rpc_method_handler,
             (False, True): grpc.unary_stream_rpc_method_handler,
             (True, False): grpc.stream_unary_rpc_method_handler,
             (True, True): grpc.stream_stream_rpc_method_handler}


def _behavior(handler: grpc.RpcMethodHandler) -> Callable:
    return (handler.unary_unary or handler.unary_stream or handler.stream_unary
            or handler.stream_stream)


# Health checks need no token: Kubernetes' gRPC probes cannot send one, and the answer
# (SERVING or NOT_SERVING) says nothing that an open port does not.
PUBLIC_METHODS = "/grpc.health.v1.Health/"


def same_shape(handler: grpc.RpcMethodHandler, behavior: Callable) -> grpc.RpcMethodHandler:
    """A handler of the same streaming kind that receives raw bytes (no deserializer)."""
    make = _HANDLERS[(handler.request_streaming, handler.response_streaming)]
    return make(behavior, request_deserializer=None, response_serializer=handler.response_serializer)


class TokenAuth(grpc.ServerInterceptor):
    """Refuses every call whose metadata lacks the shard's token, before any handler runs."""

    def __init__(self, token: str) -> None:
        self._expected = token.encode()

    def intercept_service(self, continuation, details):
        handler = continuation(details)          # a lookup only; nothing runs yet
        if handler is None:
            return None                          # unknown method: UNIMPLEMENTED
        if details.method.startswith(PUBLIC_METHODS):
            return handler
        why = refusal(self._presented(details.invocation_metadata), self._expected)
        if why is None:
            return handler

        def refuse(request, context):            # the request is never parsed
            context.abort(grpc.StatusCode.UNAUTHENTICATED, why)
        return same_shape(handler, refuse)

    @staticmethod
    def _presented(metadata) -> bytes | None:
        for key, value in metadata or ():
            if key == METADATA_KEY:       # gRPC lowercases keys
                raw = value if isinstance(value, bytes) else value.encode("utf-8", "replace")
                return raw[len(SCHEME):] if raw.startswith(SCHEME.encode()) else b""
        return None


class SafeDecode(grpc.ServerInterceptor):
    """Parses requests in the handler: bytes that are not the method's message become
    INVALID_ARGUMENT (gRPC itself would answer INTERNAL, which means a bug)."""

    def intercept_service(self, continuation, details):
        handler = continuation(details)
        if handler is None or handler.request_deserializer is None:
            return handler
        parse, behavior = handler.request_deserializer, _behavior(handler)
        method = details.method.rpartition("/")[2]
        if handler.request_streaming:
            def run(requests, context):
                return behavior(_parsed(requests, parse, method), context)
        else:
            def run(request, context):
                try:
                    message = parse(request)
                except Exception:
                    context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                  f"request: {len(request)} bytes are not a valid {method} request")
                return behavior(message, context)
        return same_shape(handler, run)


def _parsed(requests: Iterator[bytes], parse: Callable, method: str) -> Iterator:
    # Raised as the servicer reads the stream, so the servicer's one translation point
    # (pserver.errors -> status code) turns it into INVALID_ARGUMENT.
    try:
        for i, raw in enumerate(requests):
            try:
                message = parse(raw)
            except Exception:
                raise InvalidArgument(f"request: message {i} of the {method} stream ({len(raw)} bytes) "
                                      f"is not a valid message") from None
            yield message
    except grpc.RpcError:
        # gRPC ended the call mid-stream (cancelled, past its deadline, a message over the
        # size limit). As a pserver error the shard counts the push as rejected, so
        # received == applied + aggregated + dropped + rejected still holds.
        raise rpc_error_for("CANCELLED", f"request: the {method} stream was cut off before its end "
                                         f"(cancelled, past its deadline or over the size limit)") from None


def server_interceptors(token: str | None, *more: grpc.ServerInterceptor) -> list[grpc.ServerInterceptor]:
    """Authentication first (nothing of a refused call is parsed), then `more`, then safe
    decoding."""
    return ([TokenAuth(token)] if token else []) + [*more, SafeDecode()]


# --- the client side ------------------------------------------------------------------
class _Details(collections.namedtuple("_Details", ("method", "timeout", "metadata", "credentials",
                                                   "wait_for_ready", "compression")),
               grpc.ClientCallDetails):
    pass


class TokenMetadata(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor,
                    grpc.StreamUnaryClientInterceptor, grpc.StreamStreamClientInterceptor):
    """Adds `authorization: Bearer <token>` to every call on a channel, streams included."""

    def __init__(self, token: str) -> None:
        self._pair = (METADATA_KEY, SCHEME + token)

    def _with_token(self, d) -> _Details:
        return _Details(d.method, d.timeout, [*(d.metadata or ()), self._pair], d.credentials,
                        getattr(d, "wait_for_ready", None), getattr(d, "compression", None))

    def intercept_unary_unary(self, continuation, details, request):
        return continuation(self._with_token(details), request)

    def intercept_unary_stream(self, continuation, details, request):
        return continuation(self._with_token(details), request)

    def intercept_stream_unary(self, continuation, details, request_iterator):
        return continuation(self._with_token(details), request_iterator)

    def intercept_stream_stream(self, continuation, details, request_iterator):
        return continuation(self._with_token(details), request_iterator)


@dataclass(frozen=True)
class ClientSecurity:
    """What a client presents: a token and the CA it trusts. Neither shows in a repr."""
    token: str | None = field(default=None, repr=False)
    ca_pem: bytes | None = field(default=None, repr=False)

    @property
    def tls(self) -> bool:
        return self.ca_pem is not None

    def channel(self, address: str, options: list) -> grpc.Channel:
        if self.ca_pem is None:
            channel = grpc.insecure_channel(address, options=options)
        else:
            creds = grpc.ssl_channel_credentials(root_certificates=self.ca_pem)
            channel = grpc.secure_channel(address, creds, options=options)
        return grpc.intercept_channel(channel, TokenMetadata(self.token)) if self.token else channel


def client_security(token: str | None, tls_ca: str | None) -> ClientSecurity:
    """A resolved token (see resolve_token) and a CA path -> ClientSecurity; ConfigError for
    a bad token or an unreadable CA file."""
    ca = read_pem(tls_ca, "--tls-ca", "CERTIFICATE") if tls_ca else None
    return ClientSecurity(check_token(token, "--auth-token") if token is not None else None, ca)
