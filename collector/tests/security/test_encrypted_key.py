"""An encrypted (passphrase-protected) ``tls.key_file`` is refused, never prompted for.

OpenSSL's default is to ask for the passphrase on the terminal: ``serve`` waited at
"Enter PEM pass phrase:" under a TTY, failed with a bare "Invalid argument" without one,
and grpcio cannot use such a key anyway. Start-up stops with exit code 2 and a message
naming the key; a rotation to an encrypted key keeps the pair in use, as any invalid
file does.
"""

from __future__ import annotations

import os
import socket
import ssl
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import wait_for
from cryptography.hazmat.primitives import serialization
from durable_sessions_collector import credentials
from tls_certs import make_cert

ENCRYPTED = "the private key is encrypted (passphrase-protected), which is not supported"


def encrypt(key: Path, into: Path) -> Path:
    private = serialization.load_pem_private_key(key.read_bytes(), password=None)
    into.write_bytes(
        private.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.BestAvailableEncryption(b"hunter22"),
        )
    )
    return into


def test_serve_refuses_an_encrypted_key_without_asking_for_its_passphrase(tmp_path: Path) -> None:
    _, cert, key = make_cert(tmp_path)
    encrypted = encrypt(key, tmp_path / "encrypted-key.pem")
    env = {k: v for k, v in os.environ.items() if not k.startswith("DURABLE_SESSIONS_")}
    result = subprocess.run(
        [sys.executable, "-m", "durable_sessions_collector", "serve",
         "--store", f"sqlite:///{tmp_path / 's.db'}",
         "--grpc-endpoint", "127.0.0.1:0", "--http-endpoint", "127.0.0.1:0",
         "--tls-cert-file", str(cert), "--tls-key-file", str(encrypted)],
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=30,
        env=env,
        start_new_session=True,  # no controlling terminal: OpenSSL's prompt would fail, not wait
    )  # fmt: skip
    assert result.returncode == 2, result.stderr
    assert result.stdout == "" and "pass phrase" not in result.stderr
    assert result.stderr == (
        f"durable-sessions-collector: cannot start: tls.key_file: {str(encrypted)!r}: {ENCRYPTED}: "
        "decrypt it (openssl pkey -in KEY -out PLAIN_KEY) into a file only its user can read\n"
    )


def test_a_rotation_to_an_encrypted_key_keeps_the_pair_in_use(
    start_sidecar, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setattr(credentials, "CHECK_INTERVAL_S", 0.1)
    ca, cert, key = make_cert(tmp_path)
    sidecar = start_sidecar(tls__cert_file=str(cert), tls__key_file=str(key))
    encrypt(key, key)  # the same key, now behind a passphrase

    def handshake() -> str:  # handshakes are when the files are looked at
        context = ssl.create_default_context(cafile=str(ca))
        address = ("127.0.0.1", sidecar.service.http_port)
        with (
            socket.create_connection(address, timeout=10) as raw,
            context.wrap_socket(raw, server_hostname="127.0.0.1") as tls,
        ):
            return tls.version() or ""

    def failed() -> list[dict[str, object]]:
        handshake()
        return [line for line in sidecar.log.lines() if line["event"] == "tls-reload-failed"]

    wait_for(failed, timeout=5)
    (line,) = failed()
    assert ENCRYPTED in str(line["error"]) and str(key) in str(line["error"])
    assert handshake().startswith("TLS")  # still served with the key loaded at start
