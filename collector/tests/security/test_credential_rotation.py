"""Credentials rotated while the sidecar runs: the bearer token file and the TLS
certificate and key are re-read when they change (``credentials.py``), as the
OpenTelemetry Collector's ``bearertokenauth`` and ``configtls`` follow theirs.

Files are replaced by a rename, as a Kubernetes Secret volume and cert-manager do; real
TLS handshakes with Python's ssl module and grpcio, real OTLP exporters.
"""

from __future__ import annotations

import contextlib
import datetime
import io
import os
import shutil
import ssl
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import grpc
import pytest
from conftest import Sidecar, loopback_config, wait_for
from durable_sessions_collector import credentials
from durable_sessions_collector.service import Service
from hypothesis import given, settings
from hypothesis import strategies as st
from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter as GrpcExporter
from opentelemetry.sdk.trace.export import SpanExportResult
from sidecar_clients import one_action_spans
from tls_certs import make_cert

OLD_TOKEN = "old-token-0123456789abcdef"
NEW_TOKEN = "new-token-fedcba9876543210"


@pytest.fixture(autouse=True)
def quick_looks(monkeypatch: pytest.MonkeyPatch) -> None:
    """Files are looked at every 0.1 s here (1 s in production)."""
    monkeypatch.setattr(credentials, "CHECK_INTERVAL_S", 0.1)


def replace(path: Path, content: bytes | str) -> None:
    """Write ``content`` beside ``path`` and rename it over ``path`` (an atomic swap)."""
    data = content.encode() if isinstance(content, str) else content
    staged = path.with_name(path.name + ".new")
    staged.write_bytes(data)
    os.replace(staged, path)


def api_status(sidecar, token: str) -> int:  # type: ignore[no-untyped-def]
    request = urllib.request.Request(
        f"{sidecar.http_url}/api/sessions", headers={"Authorization": f"Bearer {token}"}
    )
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status
    except urllib.error.HTTPError as error:
        return error.code


def reloads(sidecar, credential: str) -> dict[str, float]:  # type: ignore[no-untyped-def]
    """``durable_sessions_credential_reloads_total`` of ``credential``, by outcome."""
    registry = sidecar.service.metrics.registry
    return {
        outcome: registry.get_sample_value(
            "durable_sessions_credential_reloads_total", {"credential": credential, "outcome": outcome}
        )
        for outcome in ("loaded", "failed")
    }


# --- the bearer token file ------------------------------------------------------------------


def test_a_rotated_token_file_is_followed_and_the_old_token_honoured_for_the_overlap(
    start_sidecar, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(credentials, "TOKEN_OVERLAP_S", 1.5)
    token_file = tmp_path / "token"
    token_file.write_text(OLD_TOKEN + "\n")
    sidecar = start_sidecar(auth__token_file=str(token_file))
    assert api_status(sidecar, OLD_TOKEN) == 200
    assert api_status(sidecar, NEW_TOKEN) == 401

    replace(token_file, NEW_TOKEN + "\n")
    wait_for(lambda: api_status(sidecar, NEW_TOKEN) == 200, timeout=5)
    rotated_at = time.monotonic()
    # The gRPC port follows the same token, with a real exporter.
    exporter = GrpcExporter(
        endpoint=sidecar.grpc_endpoint, insecure=True, headers={"authorization": f"Bearer {NEW_TOKEN}"}
    )
    assert exporter.export(one_action_spans("rotated")) == SpanExportResult.SUCCESS
    exporter.shutdown()
    # A Collector that has not yet re-read its copy still gets in, for the overlap only.
    if time.monotonic() - rotated_at < 1.0:
        assert api_status(sidecar, OLD_TOKEN) == 200
    wait_for(lambda: api_status(sidecar, OLD_TOKEN) == 401, timeout=5)
    assert time.monotonic() - rotated_at >= 1.4
    assert api_status(sidecar, NEW_TOKEN) == 200

    reloaded = [line for line in sidecar.log.lines() if line["event"] == "auth-token-reloaded"]
    assert len(reloaded) == 1 and reloaded[0]["path"] == str(token_file)
    assert reloads(sidecar, "token") == {"loaded": 1, "failed": 0}
    text = "\n".join(map(str, sidecar.log.lines()))
    assert OLD_TOKEN not in text and NEW_TOKEN not in text


def test_a_token_file_changed_before_an_embedded_service_starts_is_redacted(tmp_path: Path) -> None:
    # A program that embeds Service constructs it (its secrets go to the log's redactor)
    # and starts it later, when the token file is read again for the ports.
    token_file = tmp_path / "token"
    token_file.write_text(OLD_TOKEN)
    config = loopback_config(f"sqlite:///{tmp_path / 'sessions.db'}", {"auth.token_file": str(token_file)})
    log = io.StringIO()
    service = Service(config, log_stream=log)
    replace(token_file, NEW_TOKEN)
    service.start()
    try:
        service.log.info("a-line-with-the-token", text=f"it is {NEW_TOKEN}")
    finally:
        service.stop()
    assert NEW_TOKEN not in log.getvalue() and "a-line-with-the-token" in log.getvalue()


def test_a_bad_token_file_keeps_the_token_in_use_and_says_why(start_sidecar, tmp_path: Path) -> None:
    token_file = tmp_path / "token"
    token_file.write_text(OLD_TOKEN)
    sidecar = start_sidecar(auth__token_file=str(token_file))
    for n, bad in enumerate(("", "short", "has a space in it 0123456789"), start=1):
        replace(token_file, bad)
        _poll_until_failed(sidecar, n)
        assert api_status(sidecar, OLD_TOKEN) == 200  # clients are never locked out by a bad write
    os.unlink(token_file)
    _poll_until_failed(sidecar, 4)
    assert api_status(sidecar, OLD_TOKEN) == 200
    failed = [line for line in sidecar.log.lines() if line["event"] == "auth-token-reload-failed"]
    assert failed[-1]["level"] == "error" and "cannot read" in failed[-1]["error"]
    # Counted right after the line is written.
    wait_for(lambda: reloads(sidecar, "token") == {"loaded": 0, "failed": 4})
    assert "has a space" not in "\n".join(map(str, sidecar.log.lines()))  # the bad content never shown
    replace(token_file, NEW_TOKEN)
    wait_for(lambda: api_status(sidecar, NEW_TOKEN) == 200, timeout=5)


def _poll_until_failed(sidecar, count: int) -> None:  # type: ignore[no-untyped-def]
    """Send requests (files are looked at when requests arrive) until ``count`` failures are logged."""

    def failures() -> int:
        api_status(sidecar, OLD_TOKEN)
        return sum(line["event"] == "auth-token-reload-failed" for line in sidecar.log.lines())

    wait_for(lambda: failures() >= count, timeout=5)


def test_a_token_loaded_from_the_file_is_redacted_from_the_log(start_sidecar, tmp_path: Path) -> None:
    token_file = tmp_path / "token"
    token_file.write_text(OLD_TOKEN)
    sidecar = start_sidecar(auth__token_file=str(token_file))
    replace(token_file, NEW_TOKEN)
    wait_for(lambda: api_status(sidecar, NEW_TOKEN) == 200, timeout=5)
    sidecar.service.log.info("probe", text=f"Authorization: Bearer {NEW_TOKEN}")
    sidecar.service.log.flush()
    [probe] = [line for line in sidecar.log.lines() if line["event"] == "probe"]
    assert probe["text"] == "Authorization: Bearer ***"


# --- the TLS certificate and key --------------------------------------------------------------


def https_status(sidecar, ca: Path) -> int:  # type: ignore[no-untyped-def]
    context = ssl.create_default_context(cafile=str(ca))
    url = f"https://127.0.0.1:{sidecar.service.http_port}/healthz"
    with urllib.request.urlopen(url, timeout=10, context=context) as response:
        return response.status


def grpc_export_ok(sidecar, ca: Path) -> bool:  # type: ignore[no-untyped-def]
    exporter = GrpcExporter(
        endpoint=sidecar.grpc_endpoint,
        insecure=False,
        credentials=grpc.ssl_channel_credentials(root_certificates=ca.read_bytes()),
        timeout=5,
    )
    try:
        return exporter.export(one_action_spans("tls-rotated")) == SpanExportResult.SUCCESS
    finally:
        exporter.shutdown()


def two_certificates(tmp_path: Path) -> tuple[tuple[Path, Path, Path], tuple[Path, Path, Path], Path, Path]:
    """Two (CA, certificate, key) sets from different CAs, and the files the sidecar is
    given, holding the first set's certificate and key."""
    for name in ("first", "second", "live"):
        (tmp_path / name).mkdir()
    first, second = make_cert(tmp_path / "first"), make_cert(tmp_path / "second")
    cert_file, key_file = tmp_path / "live" / "tls.crt", tmp_path / "live" / "tls.key"
    shutil.copy(first[1], cert_file)
    shutil.copy(first[2], key_file)
    return first, second, cert_file, key_file


def test_a_renewed_certificate_is_served_on_both_ports_without_a_restart(
    start_sidecar, tmp_path: Path
) -> None:
    (first_ca, _, _), (second_ca, second_cert, second_key), cert_file, key_file = two_certificates(tmp_path)
    sidecar = start_sidecar(tls__cert_file=str(cert_file), tls__key_file=str(key_file))
    assert https_status(sidecar, first_ca) == 200
    assert grpc_export_ok(sidecar, first_ca)

    replace(key_file, second_key.read_bytes())
    replace(cert_file, second_cert.read_bytes())

    wait_for(lambda: _https_ok(sidecar, second_ca), timeout=5)
    assert not _https_ok(sidecar, first_ca)  # the old certificate is no longer served
    assert wait_for(lambda: grpc_export_ok(sidecar, second_ca), timeout=20)
    assert not grpc_export_ok(sidecar, first_ca)
    # The new pair is served before the reload is logged, and counted after.
    wait_for(lambda: any(line["event"] == "tls-reloaded" for line in sidecar.log.lines()))
    wait_for(lambda: reloads(sidecar, "tls")["loaded"] >= 1)
    assert reloads(sidecar, "tls")["failed"] == 0
    # The expiry served is the renewed certificate's (the test CA's certificates differ by
    # seconds at most: compare with what cryptography reads from the new one).
    served = sidecar.service.metrics.registry.get_sample_value(
        "durable_sessions_tls_certificate_expiry_timestamp_seconds"
    )
    assert served == not_valid_after(second_cert)


def refused_reload(sidecar: Sidecar, ca: Path) -> dict[str, Any]:
    """The one ``tls-reload-failed`` line, once a handshake has made the sidecar look at
    its files, after checking that both ports still serve the pair ``ca`` verifies."""

    def failed() -> bool:
        https_status(sidecar, ca)  # handshakes are when the files are looked at
        return any(line["event"] == "tls-reload-failed" for line in sidecar.log.lines())

    wait_for(failed, timeout=5)
    assert https_status(sidecar, ca) == 200
    assert grpc_export_ok(sidecar, ca)
    [line] = [line for line in sidecar.log.lines() if line["event"] == "tls-reload-failed"]
    return line


def test_a_certificate_and_key_that_do_not_match_keep_the_pair_in_use(start_sidecar, tmp_path: Path) -> None:
    # A renewal written file by file: for a moment the new certificate sits beside the old
    # key. The pair in use stays until the files match again.
    (first_ca, _, _), (second_ca, second_cert, second_key), cert_file, key_file = two_certificates(tmp_path)
    sidecar = start_sidecar(tls__cert_file=str(cert_file), tls__key_file=str(key_file))

    replace(cert_file, second_cert.read_bytes())  # the key is still the first one
    line = refused_reload(sidecar, first_ca)
    assert line["level"] == "error" and str(cert_file) in line["error"]
    wait_for(lambda: reloads(sidecar, "tls") == {"loaded": 0, "failed": 1})  # counted after the line

    replace(key_file, second_key.read_bytes())
    wait_for(lambda: _https_ok(sidecar, second_ca), timeout=5)
    assert wait_for(lambda: grpc_export_ok(sidecar, second_ca), timeout=20)


def test_a_renewal_to_an_expired_certificate_keeps_the_one_in_use(start_sidecar, tmp_path: Path) -> None:
    # A renewal that wrote back an old certificate (a restored backup, a stale Secret):
    # serving it would fail every client's handshake, where the one in use still verifies.
    (first_ca, first_cert, _), _, cert_file, key_file = two_certificates(tmp_path)
    (tmp_path / "expired").mkdir()
    _, expired_cert, expired_key = make_cert(tmp_path / "expired", expired=True)
    sidecar = start_sidecar(tls__cert_file=str(cert_file), tls__key_file=str(key_file))

    replace(key_file, expired_key.read_bytes())
    replace(cert_file, expired_cert.read_bytes())
    line = refused_reload(sidecar, first_ca)
    assert line["level"] == "error" and "expired" in line["error"] and str(cert_file) in line["error"]
    assert reloads(sidecar, "tls") == {"loaded": 0, "failed": 1}
    served = sidecar.service.metrics.registry.get_sample_value(
        "durable_sessions_tls_certificate_expiry_timestamp_seconds"
    )
    assert served == not_valid_after(first_cert)


def test_an_expired_certificate_at_start_is_logged_as_an_error(start_sidecar, tmp_path: Path) -> None:
    # Started, as the OpenTelemetry Collector starts with one (the ports, /healthz and the
    # metrics stay up for the renewal to be noticed), but said at once: clients that verify
    # it refuse every connection, and nothing else in the log said why.
    _, cert, key = make_cert(tmp_path, expired=True)
    sidecar = start_sidecar(tls__cert_file=str(cert), tls__key_file=str(key))
    [line] = [line for line in sidecar.log.lines() if line["event"] == "tls-certificate-expired"]
    assert line["level"] == "error" and line["cert_file"] == str(cert)
    expiry = datetime.datetime.fromisoformat(line["not_after"]).timestamp()
    assert expiry == not_valid_after(cert)


def not_valid_after(cert: Path) -> float:
    from cryptography import x509

    return x509.load_pem_x509_certificate(cert.read_bytes()).not_valid_after_utc.timestamp()


def test_the_expiry_is_read_from_the_served_certificate(tmp_path: Path) -> None:
    ca, cert, _ = make_cert(tmp_path)
    assert credentials.certificate_not_after(cert.read_bytes()) == not_valid_after(cert)
    chain = cert.read_bytes() + ca.read_bytes()  # a chain file: the first is the one served
    assert credentials.certificate_not_after(chain) == not_valid_after(cert)
    assert credentials.certificate_not_after(b"junk\n" + cert.read_bytes()) == not_valid_after(cert)


def test_rfc_5280_times_and_a_long_form_length() -> None:
    assert credentials._der_time(0x17, "491231235959Z") == 2524607999.0  # UTCTime 49: 2049
    assert credentials._der_time(0x17, "500101000000Z") == -631152000.0  # UTCTime 50: 1950
    assert credentials._der_time(0x18, "99991231235959Z") == 253402300799.0  # GeneralizedTime
    long_form = bytes([0x04, 0x81, 200]) + b"x" * 200 + bytes([0x05, 0x00])
    assert credentials._der_items(long_form) == [(0x04, b"x" * 200), (0x05, b"")]


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=300))
def test_anything_else_is_a_value_error(body: bytes) -> None:
    import base64

    pem = b"-----BEGIN CERTIFICATE-----\n" + base64.encodebytes(body) + b"-----END CERTIFICATE-----\n"
    with contextlib.suppress(ValueError):
        credentials.certificate_not_after(pem)


def _https_ok(sidecar, ca: Path) -> bool:  # type: ignore[no-untyped-def]
    try:
        return https_status(sidecar, ca) == 200
    except (ssl.SSLError, urllib.error.URLError):
        return False


def rotating_sidecar(start_sidecar, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, *, overlap_s: float):  # type: ignore[no-untyped-def]
    """A sidecar whose token, OLD_TOKEN, is read from a file that a test then rotates."""
    monkeypatch.setattr(credentials, "TOKEN_OVERLAP_S", overlap_s)
    token_file = tmp_path / "token"
    token_file.write_text(OLD_TOKEN)
    return start_sidecar(auth__token_file=str(token_file)), token_file


def _watch_alerts(channel: grpc.Channel, metadata: tuple[tuple[str, str], ...]) -> Any:
    from durable_sessions_collector.api.v1 import sessions_pb2 as pb
    from durable_sessions_collector.api.v1 import sessions_pb2_grpc as pb_grpc

    stream = pb_grpc.SessionServiceStub(channel).WatchAlerts(
        pb.WatchAlertsRequest(), metadata=metadata, timeout=30
    )
    stream.initial_metadata()  # open
    return stream


def _health_watch(channel: grpc.Channel, metadata: tuple[tuple[str, str], ...]) -> Any:
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    request = health_pb2.HealthCheckRequest(service="")
    stream = health_pb2_grpc.HealthStub(channel).Watch(request, metadata=metadata, timeout=30)
    assert next(stream).status == health_pb2.HealthCheckResponse.SERVING
    return stream


@pytest.mark.parametrize("open_stream", [_watch_alerts, _health_watch], ids=["WatchAlerts", "health-Watch"])
def test_an_open_stream_ends_once_its_token_is_no_longer_accepted(
    start_sidecar, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, open_stream: Any
) -> None:
    # The token was checked when a stream opened, only: a WatchAlerts opened with a token
    # rotated out (a leaked one, say) went on receiving every alert.
    sidecar, token_file = rotating_sidecar(start_sidecar, tmp_path, monkeypatch, overlap_s=1.0)
    with grpc.insecure_channel(sidecar.grpc_endpoint) as channel:
        stream = open_stream(channel, (("authorization", f"Bearer {OLD_TOKEN}"),))
        time.sleep(1.5)
        assert stream.is_active()  # still accepted: nothing has changed
        replace(token_file, NEW_TOKEN)
        wait_for(lambda: api_status(sidecar, NEW_TOKEN) == 200, timeout=5)
        rotated_at = time.monotonic()
        with pytest.raises(grpc.RpcError) as ended:
            next(stream)
    assert ended.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert "no longer accepted" in ended.value.details()
    assert 0.5 <= time.monotonic() - rotated_at <= 10  # after the overlap, within about a second
