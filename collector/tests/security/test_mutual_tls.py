"""Mutual TLS (``tls.client_ca_file``): on both ports, only clients presenting a
certificate signed by that CA get past the handshake; real SDK exporters with client
certificates, real TLS clients without one or with another CA's."""

from __future__ import annotations

import json
import os
import ssl
import urllib.error
import urllib.request
from pathlib import Path

import grpc
import pytest
from conftest import serve_refused, wait_for
from durable_sessions_collector.config import ConfigError, load
from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter as GrpcExporter
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as HttpExporter
from opentelemetry.sdk.trace.export import SpanExportResult
from sidecar_clients import Agent, one_action_spans
from tls_certs import make_cert, mutual_tls_pki


@pytest.fixture(autouse=True)
def _no_ca_bundle_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("REQUESTS_CA_BUNDLE", raising=False)
    monkeypatch.delenv("CURL_CA_BUNDLE", raising=False)


@pytest.fixture
def pki(tmp_path: Path) -> dict[str, Path]:
    return mutual_tls_pki(tmp_path)


@pytest.fixture
def mutual(start_sidecar, pki):  # type: ignore[no-untyped-def]
    return start_sidecar(
        tls__cert_file=str(pki["cert"]), tls__key_file=str(pki["key"]), tls__client_ca_file=str(pki["ca"])
    )


def https_get(sidecar, path: str, pki: dict[str, Path], client: str | None) -> int:  # type: ignore[no-untyped-def]
    context = ssl.create_default_context(cafile=str(pki["ca"]))
    if client is not None:
        context.load_cert_chain(pki[f"{client}_cert"], pki[f"{client}_key"])
    request = urllib.request.Request(f"https://127.0.0.1:{sidecar.service.http_port}{path}")
    with urllib.request.urlopen(request, timeout=10, context=context) as response:
        return response.status


def grpc_exporter(sidecar, pki: dict[str, Path], client: str | None) -> GrpcExporter:  # type: ignore[no-untyped-def]
    pair = {} if client is None else {
        "private_key": pki[f"{client}_key"].read_bytes(), "certificate_chain": pki[f"{client}_cert"].read_bytes()
    }  # fmt: skip
    credentials = grpc.ssl_channel_credentials(root_certificates=pki["ca"].read_bytes(), **pair)
    return GrpcExporter(endpoint=sidecar.grpc_endpoint, insecure=False, credentials=credentials, timeout=5)


def test_exporters_with_a_client_certificate_are_served_on_both_ports(mutual, pki) -> None:  # type: ignore[no-untyped-def]
    grpc_agent = Agent(grpc_exporter(mutual, pki, "client"), "inc-grpc")
    grpc_agent.action("mtls-1", "a1", "tool_call")
    http_agent = Agent(
        HttpExporter(
            endpoint=f"https://127.0.0.1:{mutual.service.http_port}/v1/traces",
            certificate_file=str(pki["ca"]),
            client_certificate_file=str(pki["client_cert"]),
            client_key_file=str(pki["client_key"]),
        ),
        "inc-http",
    )
    http_agent.action("mtls-1", "a2", "tool_call")
    context = ssl.create_default_context(cafile=str(pki["ca"]))
    context.load_cert_chain(pki["client_cert"], pki["client_key"])
    url = f"https://127.0.0.1:{mutual.service.http_port}/api/sessions/mtls-1"
    with urllib.request.urlopen(url, timeout=10, context=context) as response:
        detail = json.loads(response.read())
    assert [a["action_id"] for a in detail["actions"]] == ["a1", "a2"]
    assert https_get(mutual, "/healthz", pki, "client") == 200
    started = next(line for line in mutual.log.lines() if line["event"] == "started")
    assert started["tls"] is True and started["auth"] == "client-certificate"
    grpc_agent.shutdown()
    http_agent.shutdown()


@pytest.mark.parametrize("client", [None, "stranger"], ids=["no-certificate", "another-ca"])
def test_a_client_without_a_certificate_of_the_ca_gets_no_further_than_the_handshake(
    mutual, pki, client
) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises((ssl.SSLError, urllib.error.URLError, ConnectionError)):
        https_get(mutual, "/healthz", pki, client)  # the probe endpoint too
    exporter = grpc_exporter(mutual, pki, client)
    assert exporter.export(one_action_spans("mtls-refused")) is SpanExportResult.FAILURE
    exporter.shutdown()
    assert https_get(mutual, "/api/sessions", pki, "client") == 200  # and nothing was stored
    context = ssl.create_default_context(cafile=str(pki["ca"]))
    context.load_cert_chain(pki["client_cert"], pki["client_key"])
    url = f"https://127.0.0.1:{mutual.service.http_port}/api/sessions"
    with urllib.request.urlopen(url, timeout=10, context=context) as response:
        assert json.loads(response.read())["sessions"] == []


def test_a_client_ca_without_a_server_certificate_is_refused_naming_the_key(tmp_path: Path) -> None:
    ca, _, _ = make_cert(tmp_path)
    with pytest.raises(ConfigError, match=r"tls.cert_file: required when tls.client_ca_file is set"):
        load(None, env={"DURABLE_SESSIONS_TLS_CLIENT_CA_FILE": str(ca)}, overrides={})


@pytest.mark.parametrize(
    "content", ["", "-----BEGIN PRIVATE KEY-----\nnot a CA\n-----END PRIVATE KEY-----\n"]
)
def test_a_client_ca_file_without_a_certificate_stops_start_up_naming_the_file(
    tmp_path: Path, pki, content: str
) -> None:  # type: ignore[no-untyped-def]
    # OpenSSL's words alone ("Empty certificate data", "no start line") did not say which
    # file, and the key name alone not which path the sidecar had been given.
    client_ca = tmp_path / "client-ca.pem"
    client_ca.write_text(content)
    result = serve_refused(
        tmp_path,
        "--grpc-endpoint", "127.0.0.1:0", "--http-endpoint", "127.0.0.1:0",
        "--tls-cert-file", str(pki["cert"]), "--tls-key-file", str(pki["key"]),
        "--tls-client-ca-file", str(client_ca),
    )  # fmt: skip
    assert result.stderr.startswith(
        f"durable-sessions-collector: cannot start: tls.client_ca_file: cannot load a CA certificate "
        f"from {str(client_ca)!r}: "
    )


def test_a_port_open_to_other_hosts_is_warned_about_unless_tls_and_some_authentication(
    start_sidecar, pki
) -> None:  # type: ignore[no-untyped-def]
    def warnings(**settings: str) -> list[str]:
        sidecar = start_sidecar(receivers__http__endpoint="0.0.0.0:0", **settings)
        notes = [line["note"] for line in sidecar.log.lines() if line["event"] == "not-loopback"]
        sidecar.stop()
        return notes

    assert warnings() == [
        "the port is reachable from other hosts; set auth.token or tls.client_ca_file and tls.cert_file"
    ]
    tls = {"tls__cert_file": str(pki["cert"]), "tls__key_file": str(pki["key"])}
    assert warnings(**tls) == ["the port is reachable from other hosts; set auth.token or tls.client_ca_file"]
    assert warnings(**tls, tls__client_ca_file=str(pki["ca"])) == []


def test_a_replaced_client_ca_is_required_from_the_next_handshake(start_sidecar, pki, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    served_ca = tmp_path / "served-ca.pem"
    served_ca.write_bytes(pki["ca"].read_bytes())
    sidecar = start_sidecar(
        tls__cert_file=str(pki["cert"]), tls__key_file=str(pki["key"]), tls__client_ca_file=str(served_ca)
    )
    assert https_get(sidecar, "/healthz", pki, "client") == 200
    with pytest.raises((ssl.SSLError, urllib.error.URLError, ConnectionError)):
        https_get(sidecar, "/healthz", pki, "stranger")
    # The other CA replaces ours, by rename, as a Kubernetes Secret volume swaps its files.
    replacement = tmp_path / "next-ca.pem"
    replacement.write_bytes((tmp_path / "theirs" / "ca.pem").read_bytes())
    os.replace(replacement, served_ca)

    def stranger_admitted() -> bool:
        try:
            return https_get(sidecar, "/healthz", pki, "stranger") == 200
        except (ssl.SSLError, urllib.error.URLError, ConnectionError):
            return False

    wait_for(stranger_admitted, timeout=10)
    with pytest.raises((ssl.SSLError, urllib.error.URLError, ConnectionError)):
        https_get(sidecar, "/healthz", pki, "client")
    exporter = grpc_exporter(sidecar, pki, "client")  # the gRPC port follows too
    assert exporter.export(one_action_spans("after-rotation")) is SpanExportResult.FAILURE
    exporter.shutdown()
    assert any(line["event"] == "tls-reloaded" for line in sidecar.log.lines())
