"""Security: TLS on both ports, the bearer token on receivers and APIs, secrets never logged.

The certificate is made here with ``cryptography``; the SDK's real OTLP exporters (gRPC
and HTTP) export over TLS with the token exactly as the Collector's ``bearertokenauth``
sends it (``authorization: Bearer <token>``).
"""

from __future__ import annotations

import json
import os
import ssl
import subprocess
import sys
import urllib.error
import urllib.request
import uuid
from pathlib import Path

import grpc
import pytest
from conftest import serve_refused, wait_for
from durable_sessions_collector.api.v1 import sessions_pb2 as pb
from durable_sessions_collector.api.v1.sessions_pb2_grpc import SessionServiceStub
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter as GrpcExporter
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as HttpExporter
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceResponse
from opentelemetry.sdk.trace.export import SpanExportResult
from sidecar_clients import Agent, export_call, one_action_spans
from tls_certs import make_cert
from webhook_server import WebhookServer, free_port

TOKEN = "tok-" + uuid.uuid4().hex  # unique, so finding it anywhere is meaningful


@pytest.fixture(autouse=True)
def no_ca_bundle_override(monkeypatch: pytest.MonkeyPatch) -> None:
    """requests lets $REQUESTS_CA_BUNDLE / $CURL_CA_BUNDLE override a session's CA file,
    and so the HTTP exporter's ``certificate_file`` (psf/requests#3829): unset them here."""
    monkeypatch.delenv("REQUESTS_CA_BUNDLE", raising=False)
    monkeypatch.delenv("CURL_CA_BUNDLE", raising=False)


@pytest.fixture
def tls_files(tmp_path: Path) -> tuple[Path, Path, Path]:
    """(CA, server certificate, server key)."""
    return make_cert(tmp_path)


@pytest.fixture
def secure(start_sidecar, tls_files):  # type: ignore[no-untyped-def]
    _, cert, key = tls_files
    return start_sidecar(
        tls__cert_file=str(cert), tls__key_file=str(key), auth__token=TOKEN, log_level="DEBUG"
    )


def https_get(sidecar, path: str, cert: Path, token: str | None = None) -> tuple[int, dict, dict]:  # type: ignore[no-untyped-def, type-arg]
    context = ssl.create_default_context(cafile=str(cert))
    headers = {"Authorization": f"Bearer {token}"} if token is not None else {}
    request = urllib.request.Request(f"https://127.0.0.1:{sidecar.service.http_port}{path}", headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=10, context=context) as response:
            return response.status, dict(response.headers), json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, dict(error.headers), json.loads(error.read())


def test_real_exporters_over_tls_with_the_token_are_stored(secure, tls_files) -> None:  # type: ignore[no-untyped-def]
    cert, _, _ = tls_files  # the CA that clients trust
    ca = cert.read_bytes()
    grpc_agent = Agent(
        GrpcExporter(
            endpoint=secure.grpc_endpoint,
            insecure=False,
            credentials=grpc.ssl_channel_credentials(root_certificates=ca),
            headers={"authorization": f"Bearer {TOKEN}"},
        ),
        "inc-grpc",
    )
    grpc_agent.action("tls-1", "a1", "tool_call")
    http_agent = Agent(
        HttpExporter(
            endpoint=f"https://127.0.0.1:{secure.service.http_port}/v1/traces",
            certificate_file=str(cert),
            headers={"Authorization": f"Bearer {TOKEN}"},
        ),
        "inc-http",
    )
    http_agent.action("tls-1", "a2", "tool_call")

    status, _, detail = https_get(secure, "/api/sessions/tls-1", cert, TOKEN)
    assert status == 200
    assert [(a["action_id"], a["incarnation"]) for a in detail["actions"]] == [
        ("a1", "inc-grpc"),
        ("a2", "inc-http"),
    ]
    status, _, listed = https_get(secure, "/api/sessions", cert, TOKEN)
    assert status == 200 and [s["session_id"] for s in listed["sessions"]] == ["tls-1"]
    # /healthz stays open (for probes); nothing else does.
    assert https_get(secure, "/healthz", cert)[:1] == (200,)
    grpc_agent.shutdown()
    http_agent.shutdown()
    started = next(line for line in secure.log.lines() if line["event"] == "started")
    assert started["tls"] is True and started["auth"] == "bearer"


def test_a_missing_or_wrong_token_is_rejected_on_every_port(secure, tls_files) -> None:  # type: ignore[no-untyped-def]
    cert, _, _ = tls_files  # the CA that clients trust
    ca = cert.read_bytes()
    # Real exporters without the right token fail (and are not retried: 401 / UNAUTHENTICATED).
    for headers in (None, {"authorization": "Bearer wrong-token-0123456789"}):
        exporter = GrpcExporter(
            endpoint=secure.grpc_endpoint,
            insecure=False,
            credentials=grpc.ssl_channel_credentials(root_certificates=ca),
            headers=headers,
            timeout=5,
        )
        assert exporter.export(one_action_spans("denied")) == SpanExportResult.FAILURE
        exporter.shutdown()
        http = HttpExporter(
            endpoint=f"https://127.0.0.1:{secure.service.http_port}/v1/traces",
            certificate_file=str(cert),
            headers=None if headers is None else {"Authorization": headers["authorization"]},
            timeout=5,
        )
        assert http.export(one_action_spans("denied")) == SpanExportResult.FAILURE
        http.shutdown()

    # The gRPC status is UNAUTHENTICATED, for a wrong scheme too.
    channel = grpc.secure_channel(secure.grpc_endpoint, grpc.ssl_channel_credentials(root_certificates=ca))
    export = export_call(channel)
    body = encode_spans(one_action_spans("denied")).SerializeToString()
    for metadata in ((), (("authorization", f"Basic {TOKEN}"),), (("authorization", f"Bearer {TOKEN}x"),)):
        with pytest.raises(grpc.RpcError) as caught:
            export(body, metadata=metadata, timeout=5)
        assert caught.value.code() == grpc.StatusCode.UNAUTHENTICATED
    # …and the right token is accepted on the same channel.
    assert (
        export(body, metadata=(("authorization", f"Bearer {TOKEN}"),), timeout=5)
        == ExportTraceServiceResponse()
    )
    # The gRPC API on the same port too: unary and server-streaming methods alike.
    api = SessionServiceStub(channel)
    for call in (
        lambda md: api.ListSessions(pb.ListSessionsRequest(), metadata=md, timeout=5),
        lambda md: list(api.WatchAlerts(pb.WatchAlertsRequest(), metadata=md, timeout=5)),
    ):
        for metadata in ((), (("authorization", "Bearer wrong-token-0123456789"),)):
            with pytest.raises(grpc.RpcError) as caught:
                call(metadata)
            assert caught.value.code() == grpc.StatusCode.UNAUTHENTICATED
    good = (("authorization", f"Bearer {TOKEN}"),)
    listed = api.ListSessions(pb.ListSessionsRequest(), metadata=good, timeout=5)
    assert [s.session_id for s in listed.sessions] == ["denied"]
    channel.close()

    # HTTP: 401 with a Bearer challenge on the receiver and on every API path but /healthz.
    for path in ("/api/sessions", "/api/sessions/denied", "/metrics"):
        for token in (None, "wrong-token-0123456789"):
            status, headers, document = https_get(secure, path, cert, token)
            assert status == 401, path
            assert headers["WWW-Authenticate"].startswith('Bearer realm="durable-sessions"')
            assert "error" in document
    assert https_get(secure, "/api/sessions", cert, TOKEN)[0] == 200
    status, _, session = https_get(secure, "/api/sessions/denied", cert, TOKEN)
    assert status == 200 and session["action_count"] == 1  # only the one Export with the token
    assert secure.service.store.count_actions() == 1

    # Plain HTTP to the TLS port gets no answer.
    with pytest.raises((urllib.error.URLError, ConnectionError)):
        urllib.request.urlopen(f"http://127.0.0.1:{secure.service.http_port}/healthz", timeout=5)


def test_the_token_and_webhook_credentials_never_reach_the_log(start_sidecar, tls_files) -> None:  # type: ignore[no-untyped-def]
    ca, cert, key = tls_files
    password, signature = "pw-" + uuid.uuid4().hex, "sig-" + uuid.uuid4().hex
    with WebhookServer(fail_first=1, fail_status=503) as hook:
        url = hook.url.replace("http://", f"http://alerts:{password}@") + f"?sig={signature}"
        sidecar = start_sidecar(
            tls__cert_file=str(cert),
            tls__key_file=str(key),
            auth__token=TOKEN,
            alerts__webhook__url=url,
            alerts__webhook__backoff_s=0.05,
            log_level="DEBUG",
        )
        agent = Agent(
            GrpcExporter(
                endpoint=sidecar.grpc_endpoint,
                insecure=False,
                credentials=grpc.ssl_channel_credentials(root_certificates=ca.read_bytes()),
                headers={"authorization": f"Bearer {TOKEN}"},
            ),
            "inc-1",
        )
        agent.action("leak-1", "p1", "payment")  # unkeyed: an alert, first refused, then delivered
        wait_for(lambda: len(hook.accepted) == 1)
        https_get(sidecar, "/api/sessions", ca, "wrong-" + TOKEN)  # a rejected token is not logged either
        agent.shutdown()
        # The receiver got the credentials as Basic auth and the query it was given.
        assert hook.accepted[0].headers["authorization"].startswith("Basic ")
        assert hook.accepted[0].path.endswith(f"?sig={signature}")
        # Whatever a component writes, a secret in it is masked (the log's last line of defence).
        sidecar.service.log.error("probe", detail=f"<{TOKEN}> <{password}> <{signature}>", url=url)
        sidecar.stop()

    text = "".join(sidecar.log._text)
    probe = next(line for line in sidecar.log.lines() if line["event"] == "probe")
    assert probe["detail"] == "<***> <***> <***>"
    assert probe["url"] == "***"
    events = {line["event"] for line in sidecar.log.lines()}
    assert {"started", "alert-delivery-retry", "violation", "stopped", "http-request"} <= events
    retry = next(line for line in sidecar.log.lines() if line["event"] == "alert-delivery-retry")
    assert retry["url"] == f"http://***@127.0.0.1:{hook.port}/***?sig=***"
    for secret in (TOKEN, password, signature):
        assert secret not in text


def test_config_output_redacts_the_secrets(tmp_path: Path) -> None:
    password = "pw-" + uuid.uuid4().hex
    env = {
        **os.environ,
        "DURABLE_SESSIONS_AUTH_TOKEN": TOKEN,
        "DURABLE_SESSIONS_WEBHOOK_URL": f"https://ops:{password}@alerts.example/hook?key=abc123secret",
    }
    result = subprocess.run(
        [sys.executable, "-m", "durable_sessions_collector", "config"],
        capture_output=True,
        text=True,
        timeout=30,
        env=env,
    )
    assert result.returncode == 0, result.stderr
    settings = json.loads(result.stdout)["settings"]
    assert settings["auth.token"] == "***"
    assert settings["alerts.webhook.url"] == "https://***@alerts.example/***?key=***"
    for secret in (TOKEN, password, "abc123secret"):
        assert secret not in result.stdout + result.stderr


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"DURABLE_SESSIONS_TLS_CERT_FILE": "{cert}"}, "tls.key_file: required when tls.cert_file is set"),
        ({"DURABLE_SESSIONS_TLS_KEY_FILE": "/nonexistent/key.pem"}, "tls.key_file: no such file"),
        ({"DURABLE_SESSIONS_AUTH_TOKEN": "short"}, "auth.token: expected a bearer token of at least 16"),
        (
            {"DURABLE_SESSIONS_AUTH_TOKEN": "has a space in it, 1234"},
            "auth.token: expected a bearer token of",
        ),
    ],
)
def test_invalid_security_settings_stop_start_up_without_echoing_the_token(
    tmp_path: Path,
    tls_files,
    env: dict,
    message: str,  # type: ignore[type-arg]
) -> None:
    _, cert, _ = tls_files
    result = serve_refused(tmp_path, env={k: v.format(cert=cert) for k, v in env.items()})
    assert message in result.stderr
    assert "short" not in result.stderr and "has a space" not in result.stderr


def test_standard_error_stays_json_when_grpcio_has_something_to_say(tls_files, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    # A plaintext client on the TLS gRPC port makes grpcio's core log a failed handshake
    # in its own format; `serve` keeps standard error to JSON lines (log shippers parse
    # them) by silencing grpcio unless GRPC_VERBOSITY is set.
    ca, cert, key = tls_files
    grpc_port, http_port = free_port(), free_port()
    env = {
        name: value
        for name, value in os.environ.items()
        if not name.startswith(("DURABLE_SESSIONS_", "GRPC_"))
    }
    process = subprocess.Popen(
        [
            sys.executable, "-m", "durable_sessions_collector", "serve",
            f"--store=sqlite:///{tmp_path / 's.db'}",
            f"--grpc-endpoint=127.0.0.1:{grpc_port}", f"--http-endpoint=127.0.0.1:{http_port}",
            f"--tls-cert-file={cert}", f"--tls-key-file={key}",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        env={**env, "PYTHONUNBUFFERED": "1"},
    )  # fmt: skip
    try:
        context = ssl.create_default_context(cafile=str(ca))

        def healthy() -> bool:
            try:
                with urllib.request.urlopen(
                    f"https://localhost:{http_port}/healthz", context=context, timeout=2
                ):
                    return True
            except (OSError, urllib.error.URLError):
                return False

        wait_for(healthy, timeout=20)
        for _ in range(3):
            with grpc.insecure_channel(f"127.0.0.1:{grpc_port}") as channel, pytest.raises(grpc.RpcError):
                SessionServiceStub(channel).ListSessions(pb.ListSessionsRequest(), timeout=2)
        process.terminate()
        _, stderr = process.communicate(timeout=20)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(10)
    lines = stderr.decode().splitlines()
    assert any(json.loads(line)["event"] == "stopped" for line in lines if line.startswith("{"))
    assert [line for line in lines if not line.startswith("{")] == []


@pytest.mark.parametrize(
    ("media_type", "answered_in"),
    [
        ("application/x-protobuf", "application/x-protobuf"),
        ("application/protobuf", "application/protobuf"),
        ("application/json; charset=utf-8", "application/json"),
        (None, "application/json"),
        ("text/plain", "application/json"),
    ],
)
def test_a_refused_export_is_a_status_in_the_requests_content_type(  # type: ignore[no-untyped-def]
    start_sidecar, media_type: str | None, answered_in: str
) -> None:
    """OTLP/HTTP: the response has the request's Content-Type; a 401 to an
    ``application/protobuf`` request was labelled ``application/x-protobuf``. A request
    naming none (or another) is answered in JSON, as its 415 and 405 are; its 401 was
    binary protobuf, which a client without a Content-Type (curl, a probe) cannot read."""
    import http.client

    from google.protobuf import json_format
    from google.rpc import code_pb2, status_pb2

    sidecar = start_sidecar(auth__token=TOKEN)
    connection = http.client.HTTPConnection("127.0.0.1", sidecar.service.http_port, timeout=10)
    body = b"" if media_type and "protobuf" in media_type else b"{}"
    connection.request(
        "POST", "/v1/traces", body=body, headers={"Content-Type": media_type} if media_type else {}
    )
    response = connection.getresponse()
    answer = response.read()
    connection.close()
    assert response.status == 401 and response.getheader("Content-Type") == answered_in
    status = status_pb2.Status()
    if answered_in == "application/json":
        json_format.Parse(answer, status)
    else:
        status.ParseFromString(answer)
    assert status.code == code_pb2.UNAUTHENTICATED and "token" in status.message


@pytest.mark.parametrize(
    ("cert_name", "key_name", "message"),
    [
        # Files swapped or one given twice, as a Secret's keys are easily mixed up.
        ("key", "key", "tls.cert_file: '{key}' holds no PEM certificate (-----BEGIN CERTIFICATE-----)"),
        ("cert", "cert", "tls.key_file: '{cert}' holds no PEM private key (-----BEGIN PRIVATE KEY-----)"),
        ("other", "key", "tls.key_file: '{key}' is not the private key of the certificate '{other}'"),
    ],
)
def test_a_pair_that_does_not_load_stops_start_up_naming_the_file_at_fault(
    tmp_path: Path, tls_files, cert_name: str, key_name: str, message: str
) -> None:  # type: ignore[no-untyped-def]
    # OpenSSL's own words were "[SSL] PEM lib (_ssl.c:3905)" and "KEY_VALUES_MISMATCH".
    _, cert, key = tls_files
    (tmp_path / "other").mkdir()
    _, other, _ = make_cert(tmp_path / "other")
    paths = {"cert": str(cert), "key": str(key), "other": str(other)}
    result = serve_refused(
        tmp_path,
        "--grpc-endpoint", "127.0.0.1:0", "--http-endpoint", "127.0.0.1:0",
        "--tls-cert-file", paths[cert_name], "--tls-key-file", paths[key_name],
    )  # fmt: skip
    assert result.stderr == f"durable-sessions-collector: cannot start: {message.format(**paths)}\n"


@pytest.mark.parametrize(
    ("content", "message"),
    [
        # Windows editors start a UTF-8 file with a byte order mark, which no one sees.
        (
            "\ufeff" + TOKEN + "\r\n",
            "starts with a byte order mark (U+FEFF), which Windows editors write: save the file as UTF-8 without one",
        ),
        # An Authorization header's value, where the token alone is meant.
        ("Bearer " + TOKEN + "\n", "write the token alone, without 'Bearer '"),
    ],
)
def test_a_token_file_written_as_a_person_might_is_refused_saying_what_to_change(
    tmp_path: Path, content: str, message: str
) -> None:
    token_file = tmp_path / "token"
    token_file.write_bytes(content.encode())
    result = serve_refused(tmp_path, "--auth-token-file", str(token_file))
    assert result.stderr == (
        f"durable-sessions-collector: invalid configuration: auth.token_file: {message} "
        "(value not shown) (from --auth-token-file)\n"
    )
    assert TOKEN not in result.stderr
