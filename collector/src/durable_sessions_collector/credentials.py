"""Credentials re-read while the sidecar runs: the bearer token file, and the TLS
certificate, key and client CA.

Credentials are rotated in place: a Kubernetes Secret volume swaps its files at once,
cert-manager renews a certificate weeks before it expires, a vault agent rewrites a token
file. The OpenTelemetry Collector follows such files (``bearertokenauth`` re-reads its
``filename`` when it changes, ``configtls`` has ``reload_interval``), so a sidecar that
read them once would, after a rotation, refuse every Export from a Collector that sends
the new token (``UNAUTHENTICATED``, which the Collector drops without retrying), or serve
a certificate that has expired.

Each file is looked at (``stat``: device, inode, size, modification time; a symlink is
followed, so a Secret volume's swap counts) at most once per :data:`CHECK_INTERVAL_S`,
when a request or a handshake needs the credential; nothing polls in the background. A
change is loaded if it is valid, and otherwise logged while the credentials in use stay,
so a half-written file never locks clients out. No token is ever logged.
"""

from __future__ import annotations

import datetime
import hmac
import math
import os
import ssl
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

import grpc

from durable_sessions_collector.config import read_token_file
from durable_sessions_collector.jsonlog import JsonLog
from durable_sessions_collector.security import read_pem, server_ssl_context

CHECK_INTERVAL_S = 1.0
"""Longest a changed credential file goes unnoticed while requests arrive."""

TOKEN_OVERLAP_S = 120.0
"""How long the token a new one replaced is still accepted. A Collector re-reads its own
copy of the file at its own moment (a Secret reaches each pod within a minute or so of
the other); in between, its Exports would be refused and dropped. To revoke a token at
once, restart the sidecar with the new one."""


class FileWatch:
    """Tells whether any of ``paths`` changed since the last look, looking at most once
    per ``interval_s`` (default :data:`CHECK_INTERVAL_S`; a missing file is a state too:
    its return is a change)."""

    def __init__(self, paths: Iterable[str], interval_s: float | None = None) -> None:
        self.paths = tuple(paths)
        self.interval_s = CHECK_INTERVAL_S if interval_s is None else interval_s
        self._lock = threading.Lock()
        self._seen = self._signature()
        self._next_look = time.monotonic() + self.interval_s

    def changed(self) -> bool:
        now = time.monotonic()
        if now < self._next_look:  # the common case, without the lock
            return False
        with self._lock:
            if now < self._next_look:
                return False
            self._next_look = now + self.interval_s
            signature = self._signature()
            if signature == self._seen:
                return False
            self._seen = signature
            return True

    def _signature(self) -> tuple[tuple[int, int, int, int] | None, ...]:
        found = []
        for path in self.paths:
            try:
                stat = os.stat(path)
            except OSError:
                found.append(None)
            else:
                found.append((stat.st_dev, stat.st_ino, stat.st_size, stat.st_mtime_ns))
        return tuple(found)


class BearerToken:
    """The token clients must send (``auth.token``, or ``auth.token_file`` re-read when it
    changes). ``accepts(credentials)`` compares in constant time; after a change, the
    replaced token is accepted :data:`TOKEN_OVERLAP_S` longer.

    ``on_new_token`` is called with ``token`` and each token loaded from the file, before
    it is used (the log's redactor registers it); ``on_reload`` with ``"loaded"`` or ``"failed"`` for
    each change of the file.
    """

    def __init__(
        self,
        token: str,
        *,
        path: str | None = None,
        log: JsonLog,
        on_new_token: Callable[[str], object] = lambda _token: None,
        on_reload: Callable[[str], object] = lambda _outcome: None,
        overlap_s: float | None = None,
    ) -> None:
        # The token in use is redacted too, as each one loaded later: the file can change
        # between a Service's construction, which registers its secrets, and its start.
        on_new_token(token)
        self._current = token.encode("utf-8")
        self._previous: bytes | None = None
        self._previous_until = 0.0
        self.path = path
        self.log = log
        self.on_new_token = on_new_token
        self.on_reload = on_reload
        self.overlap_s = TOKEN_OVERLAP_S if overlap_s is None else overlap_s
        self._watch = FileWatch([path]) if path is not None else None

    def accepts(self, credentials: str) -> bool:
        if self._watch is not None and self._watch.changed():
            self._reload()
        given = credentials.encode("utf-8", "surrogatepass")
        if hmac.compare_digest(given, self._current):
            return True
        previous = self._previous
        return (
            previous is not None
            and time.monotonic() < self._previous_until
            and hmac.compare_digest(given, previous)
        )

    def _reload(self) -> None:
        assert self.path is not None
        try:
            token = read_token_file(self.path)
        except ValueError as error:  # its text never repeats the token
            note = "the token in use is kept"
            self.log.write("ERROR", "auth-token-reload-failed", path=self.path, error=str(error), note=note)
            self.on_reload("failed")
            return
        new = token.encode("utf-8")
        if new == self._current:
            return  # the file was touched, not changed
        self.on_new_token(token)
        self._previous, self._previous_until = self._current, time.monotonic() + self.overlap_s
        self._current = new
        self.log.write("INFO", "auth-token-reloaded", path=self.path, previous_accepted_for_s=self.overlap_s)
        self.on_reload("loaded")


class TlsFiles:
    """The server certificate and key (``tls.cert_file``, ``tls.key_file``), and with
    ``client_ca_file`` the CA that client certificates must be signed by (mutual TLS),
    loaded again when any of the files changes: for the HTTP port, :meth:`ssl_context` for
    each handshake; for the gRPC port, :meth:`grpc_credentials`, which grpcio asks before
    each handshake.

    Construction loads the pair, and raises OSError naming the files when it does not
    load or does not match (start-up stops there). ``on_reload`` is called with
    ``"loaded"`` or ``"failed"`` for each change of the files.
    """

    def __init__(
        self,
        cert_file: str,
        key_file: str,
        *,
        log: JsonLog,
        on_reload: Callable[[str], object] = lambda _outcome: None,
        client_ca_file: str | None = None,
    ) -> None:
        self.cert_file = cert_file
        self.key_file = key_file
        self.client_ca_file = client_ca_file
        self.log = log
        self.on_reload = on_reload
        self._lock = threading.Lock()
        self._context, self._pems = self._load()
        if self.not_after < time.time():
            # Served all the same, as the OpenTelemetry Collector serves one: the ports,
            # /healthz and /metrics stay up while it is renewed, and a renewal is loaded.
            self.log.write(
                "ERROR",
                "tls-certificate-expired",
                cert_file=cert_file,
                not_after=_iso(self.not_after),
                note="clients that verify it refuse every connection; renew it (it is loaded again when it changes)",
            )
        self._version = 0  # loads so far, after the first
        self._grpc_version = 0
        self._watch = FileWatch([cert_file, key_file, *([client_ca_file] if client_ca_file else [])])

    def ssl_context(self) -> ssl.SSLContext:
        self._reload_if_changed()
        return self._context

    @property
    def not_after(self) -> float:
        """When the certificate being served expires (seconds since the epoch; NaN if its
        expiry cannot be read)."""
        try:
            return certificate_not_after(self._pems[0])
        except ValueError:
            return math.nan

    def grpc_credentials(self) -> grpc.ServerCredentials:
        return grpc.dynamic_ssl_server_credentials(
            self._grpc_configuration(),
            self._next_grpc_configuration,
            require_client_authentication=self.client_ca_file is not None,
        )

    def _next_grpc_configuration(self) -> Any:
        # grpcio calls this before each handshake: a new configuration, or None to keep it.
        try:
            self._reload_if_changed()
            with self._lock:
                if self._grpc_version == self._version:
                    return None
                self._grpc_version = self._version
            return self._grpc_configuration()
        except Exception:  # raising here would fail the client's handshake
            return None

    def _grpc_configuration(self) -> Any:
        cert, key, client_ca = self._pems
        return grpc.ssl_server_certificate_configuration([(key, cert)], root_certificates=client_ca)

    def _reload_if_changed(self) -> None:
        if not self._watch.changed():
            return
        try:
            context, pems = self._load()
            self._refuse_expired(pems[0])
        except OSError as error:
            self.log.write(
                "ERROR", "tls-reload-failed", error=str(error), note="the certificate in use is kept"
            )
            self.on_reload("failed")
            return
        with self._lock:
            self._context, self._pems = context, pems
            self._version += 1
        self.log.write(
            "INFO",
            "tls-reloaded",
            cert_file=self.cert_file,
            key_file=self.key_file,
            not_after=_iso(self.not_after),
        )
        self.on_reload("loaded")

    def _refuse_expired(self, cert: bytes) -> None:
        """Raises OSError when ``cert`` (a renewal) has expired: it would fail every client's
        handshake, where the certificate in use may still verify (a restored backup or a
        stale Secret writes an old certificate back)."""
        try:
            not_after = certificate_not_after(cert)
        except ValueError:
            return  # OpenSSL loaded it: its expiry is for the TLS clients to judge
        if not_after < time.time():
            raise OSError(f"tls.cert_file: the certificate {self.cert_file!r} expired at {_iso(not_after)}")

    def _load(self) -> tuple[ssl.SSLContext, tuple[bytes, bytes, bytes | None]]:
        pems = self._read()
        context = server_ssl_context(self.cert_file, self.key_file, pems[2], self.client_ca_file)
        # gRPC is given the bytes, the HTTP port a context loaded from the paths: both must
        # be the pair just checked, not one a writer changed in between.
        if self._read() != pems:
            raise OSError(
                "tls.cert_file/tls.key_file changed while being loaded; loading again at the next look"
            )
        return context, pems

    def _read(self) -> tuple[bytes, bytes, bytes | None]:
        return (
            read_pem(self.cert_file, "certificate", "tls.cert_file"),
            read_pem(self.key_file, "private key", "tls.key_file"),
            read_pem(self.client_ca_file, "certificate", "tls.client_ca_file")
            if self.client_ca_file
            else None,
        )


# --- when a certificate expires ---------------------------------------------------------------
# The standard library loads certificates but decodes them only through a private
# function; a certificate that OpenSSL has just loaded is well-formed DER, and its expiry
# is four fields into it (RFC 5280 section 4.1).

_UTC_TIME, _GENERALIZED_TIME, _VERSION = 0x17, 0x18, 0xA0


def certificate_not_after(pem: bytes) -> float:
    """When the first certificate in ``pem`` (the served one, in a chain file) expires,
    in seconds since the epoch. Raises ValueError if it cannot be read."""
    text = pem.decode("ascii", "replace")
    begin, end = "-----BEGIN CERTIFICATE-----", "-----END CERTIFICATE-----"
    start = text.find(begin)
    stop = text.find(end, start)
    if start < 0 or stop < 0:
        raise ValueError("no PEM certificate")
    try:
        der = ssl.PEM_cert_to_DER_cert(text[start : stop + len(end)])
        (certificate,) = _der_items(der)
        tbs = _der_items(certificate[1])[0][1]
        fields = _der_items(tbs)
        first = 1 if fields[0][0] == _VERSION else 0
        # serialNumber, signature, issuer, validity
        tag, value = _der_items(fields[first + 3][1])[1]
        return _der_time(tag, value.decode("ascii"))
    except (IndexError, ValueError) as error:  # UnicodeDecodeError and binascii.Error too
        raise ValueError(f"cannot read the certificate's expiry: {error}") from None


def _iso(timestamp: float) -> str | None:
    return (
        None
        if math.isnan(timestamp)
        else datetime.datetime.fromtimestamp(timestamp, datetime.UTC).isoformat()
    )


def _der_items(data: bytes) -> list[tuple[int, bytes]]:
    """The (tag, contents) of each DER item in ``data``, one after the other."""
    items = []
    at = 0
    while at < len(data):
        tag, length = data[at], data[at + 1]
        at += 2
        if length & 0x80:  # long form: the next (length & 0x7F) bytes are the length
            count = length & 0x7F
            length = int.from_bytes(data[at : at + count], "big")
            at += count
        if at + length > len(data):
            raise ValueError("truncated DER")
        items.append((tag, data[at : at + length]))
        at += length
    return items


def _der_time(tag: int, text: str) -> float:
    if tag == _UTC_TIME:  # YYMMDDHHMMSSZ; 50-99 are 19xx (RFC 5280 section 4.1.2.5.1)
        year = int(text[:2])
        text = f"{1900 + year if year >= 50 else 2000 + year}{text[2:]}"
    elif tag != _GENERALIZED_TIME:
        raise ValueError(f"not a certificate time (tag {tag:#x})")
    moment = datetime.datetime.strptime(text, "%Y%m%d%H%M%SZ").replace(tzinfo=datetime.UTC)
    return moment.timestamp()
