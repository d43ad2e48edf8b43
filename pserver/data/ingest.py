"""`pserver ingest`: events sent as lines over TCP, appended to the file a job follows
(`--dataset stream:FILE`, pserver.data.stream).

A socket's lines cannot be read twice, and a worker that dies must lose none of its events, so the
lines go to a file first, as a queue's broker keeps them: every complete line a connection sends
is appended to FILE whole (one connection's lines never interleave within another's), and written
through to the operating system before the next read. A connection's last bytes without a
newline are not an event: they are dropped and counted. A line longer than MAX_LINE_BYTES ends its
connection (its sender is not speaking lines). Any number of senders at once; SIGTERM or SIGINT
stops it with a line of what it took.

    pserver ingest --port 9000 --out events.tsv &
    pserver launch --ps 2 --workers 2 --model lr --dataset stream:events.tsv ...
    my-producer | nc 127.0.0.1 9000
"""

from __future__ import annotations

import os
import socket
import socketserver
import threading

from pserver.data.criteo import MAX_LINE_BYTES
from pserver.errors import ConfigError

READ_BYTES = 1 << 16


class IngestServer(socketserver.ThreadingTCPServer):
    """Listens on (host, port); appends the lines every connection sends to `out`."""

    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, out: str, port: int = 9000, host: str = "127.0.0.1") -> None:
        parent = os.path.dirname(os.path.abspath(out))
        if not os.path.isdir(parent):
            raise ConfigError(f"--out: {out} cannot be written: {parent} is not a directory")
        if os.path.isdir(out):
            raise ConfigError(f"--out: {out} is a directory; give the file to append the events to")
        self.out = out
        self.file = open(out, "ab")
        self.lock = threading.Lock()
        self.lines = self.connections = self.dropped_bytes = self.refused = 0
        try:
            super().__init__((host, port), _Connection)
        except OSError as e:
            self.file.close()
            raise ConfigError(f"--port {port}: cannot listen on {host}:{port} ({e.strerror or e})") from None

    @property
    def port(self) -> int:
        return self.server_address[1]

    def append(self, data: bytes) -> None:
        """Complete lines, appended whole and written through."""
        with self.lock:
            self.file.write(data)
            self.file.flush()
            self.lines += data.count(b"\n")

    def server_close(self) -> None:
        super().server_close()
        with self.lock:
            self.file.close()

    def summary(self) -> str:
        return (f"{self.lines:,} line(s) from {self.connections} connection(s) appended to {self.out}"
                + (f"; {self.dropped_bytes:,} byte(s) after a connection's last newline dropped"
                   if self.dropped_bytes else "")
                + (f"; {self.refused} connection(s) ended for a line over {MAX_LINE_BYTES:,} bytes"
                   if self.refused else ""))


class _Connection(socketserver.BaseRequestHandler):
    def handle(self) -> None:
        server: IngestServer = self.server
        with server.lock:
            server.connections += 1
        rest = b""
        while True:
            try:
                data = self.request.recv(READ_BYTES)
            except OSError:
                break
            if not data:
                break
            data = rest + data
            cut = data.rfind(b"\n") + 1
            if cut:
                server.append(data[:cut])
            rest = data[cut:]
            if len(rest) > MAX_LINE_BYTES:
                with server.lock:
                    server.refused += 1
                    server.dropped_bytes += len(rest)
                self.request.shutdown(socket.SHUT_RDWR)
                return
        if rest:
            with server.lock:
                server.dropped_bytes += len(rest)


def ingest(out: str, port: int = 9000, host: str = "127.0.0.1", block: bool = True):
    """`pserver ingest`: block=True serves until SIGTERM or SIGINT and returns the exit code;
    block=False returns the started IngestServer (its .port, .lines, .shutdown(), .server_close())."""
    server = IngestServer(out, port, host)
    thread = threading.Thread(target=server.serve_forever, name="ingest", daemon=True)
    thread.start()
    if not block:
        return server
    import signal
    done = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: done.set())
    print(f"pserver ingest: listening on {host}:{server.port}, appending each line sent to {out}", flush=True)
    done.wait()
    server.shutdown()
    server.server_close()
    print(f"pserver ingest: stopped: {server.summary()}", flush=True)
    return 0
