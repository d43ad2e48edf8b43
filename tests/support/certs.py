"""Throwaway TLS material for tests: a CA, and a server certificate it signs for
localhost and 127.0.0.1, made with the `openssl` command line (no Python dependency)."""

from __future__ import annotations

import pathlib
import shutil
import subprocess
from dataclasses import dataclass

from tests.support.processes import missing


@dataclass(frozen=True)
class Certs:
    ca: pathlib.Path          # the CA certificate clients trust (--tls-ca)
    cert: pathlib.Path        # the shard's certificate (--tls-cert), signed by the CA
    key: pathlib.Path         # its private key (--tls-key)
    other_ca: pathlib.Path    # a CA that signed nothing here: trusting it must not help


def _openssl(*args: str, cwd: pathlib.Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=60)


def _ca(directory: pathlib.Path, name: str) -> None:
    _openssl("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes",
             "-keyout", f"{name}.key", "-out", f"{name}.pem", "-days", "2", "-subj", f"/CN={name}",
             cwd=directory)


def make_certs(directory: pathlib.Path) -> Certs:
    if shutil.which("openssl") is None:
        missing("the TLS tests", "the openssl command is not installed: cannot make test certificates "
                "(apt-get install openssl)")
    _ca(directory, "ca")
    _ca(directory, "other-ca")
    _openssl("req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes",
             "-keyout", "server.key", "-out", "server.csr", "-subj", "/CN=localhost", cwd=directory)
    (directory / "san.ext").write_text("subjectAltName=DNS:localhost,IP:127.0.0.1\n")
    _openssl("x509", "-req", "-in", "server.csr", "-CA", "ca.pem", "-CAkey", "ca.key",
             "-CAcreateserial", "-out", "server.pem", "-days", "2", "-extfile", "san.ext", cwd=directory)
    return Certs(directory / "ca.pem", directory / "server.pem", directory / "server.key",
                 directory / "other-ca.pem")
