"""``otel-config.yaml`` and the Collector configurations in ``docs/deployment.md``:
valid YAML whose pipelines reference only defined components, in 0.144+ naming."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import yaml
from durable_sessions_collector.config import OPTIONS

ROOT = Path(__file__).resolve().parents[3]
CONFIG = ROOT / "otel-config.yaml"
DEPLOYMENT = ROOT / "docs" / "deployment.md"
SECTIONS = ("receivers", "processors", "exporters", "connectors")
# Exporter types renamed, each kept as a deprecated alias: otlp and otlphttp in contrib
# 0.144, loadbalancing in 0.153 (opentelemetry-collector-contrib#48533).
DEPRECATED_TYPES = {
    "otlp": "otlp_grpc",
    "otlphttp": "otlp_http",
    "logging": "debug",
    "loadbalancing": "load_balancing",
}


def component_type(component_id: str) -> str:
    return component_id.split("/", 1)[0]


def check_references(config: dict[str, Any]) -> None:
    """Every component a pipeline or the service names is defined, and the other way round."""
    service = config["service"]
    for name in service.get("extensions", []):
        assert name in (config.get("extensions") or {}), f"service.extensions names undefined {name}"
    used: set[tuple[str, str]] = set()
    for pipeline_name, pipeline in service["pipelines"].items():
        assert pipeline.get("receivers") and pipeline.get("exporters"), pipeline_name
        for section in ("receivers", "processors", "exporters"):
            for name in pipeline.get(section, []):
                defined = config.get(section) or {}
                assert name in defined, f"pipeline {pipeline_name} names undefined {section[:-1]} {name}"
                used.add((section, name))
    for section in SECTIONS:
        for name in config.get(section) or {}:
            assert (section, name) in used, f"{section[:-1]} {name} is defined but in no pipeline"
    # Extensions referenced from components (queue storage, authenticators) are defined and started.
    for section in ("receivers", "exporters"):
        for name, settings in (config.get(section) or {}).items():
            for reference in extension_references(settings):
                assert reference in (config.get("extensions") or {}), (
                    f"{name} references undefined {reference}"
                )
                assert reference in service.get("extensions", []), f"{reference} is not in service.extensions"
    for name in config.get("exporters") or {}:  # (the receiver is still called otlp)
        check_exporter_name(name)


def check_exporter_name(name: str) -> None:
    kind = component_type(name)
    assert kind not in DEPRECATED_TYPES, f"{name}: {kind} is a deprecated alias of {DEPRECATED_TYPES[kind]}"


def extension_references(node: Any) -> list[str]:
    found = []
    if isinstance(node, dict):
        for key, value in node.items():
            if key in ("storage", "authenticator") and isinstance(value, str):
                found.append(value)
            else:
                found.extend(extension_references(value))
    elif isinstance(node, list):
        for item in node:
            found.extend(extension_references(item))
    return found


def commented_block(text: str, first_line: str) -> str:
    """A commented-out YAML block of ``text`` (from ``# first_line`` on), uncommented."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.strip() == f"# {first_line}")
    indent = lines[start].index("#")
    block = []
    for line in lines[start:]:
        if not line.strip().startswith("#") or not line[indent:].startswith("# "):
            break
        block.append(line[indent + 2 :])
    return "\n".join(block)


def test_otel_config_pipeline_references_only_defined_components() -> None:
    text = CONFIG.read_text()
    config = yaml.safe_load(text)
    check_references(config)
    assert "0.144" in text and "contrib" in text  # the version it targets is stated

    traces = config["service"]["pipelines"]["traces"]
    assert traces["receivers"] == ["otlp"]
    protocols = config["receivers"]["otlp"]["protocols"]
    assert protocols["grpc"]["endpoint"].endswith(":4317") and protocols["http"]["endpoint"].endswith(":4318")
    assert "debug" in traces["exporters"]

    [sidecar] = [name for name in traces["exporters"] if component_type(name) == "otlp_grpc"]
    exporter = config["exporters"][sidecar]
    default_grpc = next(o.default for o in OPTIONS if o.key == "receivers.grpc.endpoint")
    assert exporter["endpoint"] == default_grpc == "127.0.0.1:4319"
    queue = exporter["sending_queue"]
    assert queue["enabled"] is True
    assert component_type(queue["storage"]) == "file_storage"
    # Batched from the queue on disk, not by a batch processor holding acknowledged spans
    # in memory before it: a Collector crash would lose them.
    assert "batch" in queue and not any(
        component_type(name) == "batch" for name in traces.get("processors", [])
    )
    assert exporter["retry_on_failure"]["enabled"] is True
    # The Collector must wait longer than the sidecar takes to answer (it acks after commit).
    ack_timeout = next(o.default for o in OPTIONS if o.key == "pipeline.ack_timeout_s")
    assert float(exporter["timeout"].removesuffix("s")) > ack_timeout


def test_the_commented_load_balancing_and_token_setups_are_valid() -> None:
    text = CONFIG.read_text()
    balancing = yaml.safe_load(commented_block(text, "load_balancing/durable_sessions:"))
    [name] = balancing
    check_exporter_name(name)
    settings = balancing[name]
    assert settings["routing_key"] == "attributes"
    assert settings["routing_attributes"] == ["session.id"]
    assert set(settings["protocol"]) == {"otlp"}
    assert "endpoint" not in settings["protocol"]["otlp"]
    assert settings["resolver"]["static"]["hostnames"]
    assert settings["sending_queue"]["storage"] in yaml.safe_load(text)["extensions"]

    token = yaml.safe_load(commented_block(text, "bearertokenauth/durable_sessions:"))
    assert token["bearertokenauth/durable_sessions"]["filename"]
    auth = yaml.safe_load(commented_block(text, "auth:"))
    assert auth["auth"]["authenticator"] == "bearertokenauth/durable_sessions"


def deployment_configs() -> list[tuple[int, dict[str, Any]]]:
    blocks = re.findall(r"```yaml\n(.*?)```", DEPLOYMENT.read_text(), flags=re.S)
    return [(n, yaml.safe_load(block)) for n, block in enumerate(blocks)]


@pytest.mark.parametrize(("number", "config"), deployment_configs())
def test_deployment_guide_yaml_is_valid(number: int, config: dict[str, Any]) -> None:
    assert isinstance(config, dict), f"yaml block {number} is not a mapping"
    if "service" in config:  # a whole Collector configuration
        check_references(config)


# The settings each component takes, as the Collector's config schemas (config.schema.yaml
# of configgrpc, configtls, configretry, exporterhelper, loadbalancingexporter) and the
# READMEs of contrib's filestorage, bearertokenauth, memorylimiter, batch and debug list
# them, as of contrib 0.144 to 0.16x: the Collector refuses an unknown key at start-up
# ("has invalid keys"), so a misspelt one here is a configuration that does not start.
# A name maps to the settings under it, or to None where its value is not checked here.
Keys = dict[str, "Keys | None"]


def leaves(names: str) -> Keys:
    """Settings whose values are not checked here, named in one string."""
    return dict.fromkeys(names.split())


TLS_CLIENT: Keys = leaves(
    "insecure insecure_skip_verify server_name_override ca_file ca_pem cert_file cert_pem key_file "
    "key_pem include_system_ca_certs_pool min_version max_version cipher_suites curve_preferences "
    "reload_interval tpm"
)
QUEUE: Keys = {
    **leaves("enabled num_consumers queue_size sizer storage block_on_overflow blocking wait_for_result"),
    "batch": leaves("flush_timeout min_size max_size sizer"),
}
RETRY: Keys = leaves("enabled initial_interval randomization_factor multiplier max_interval max_elapsed_time")
GRPC_EXPORTER: Keys = {
    **leaves(
        "endpoint compression keepalive read_buffer_size write_buffer_size wait_for_ready headers "
        "balancer_name authority middlewares timeout"
    ),
    "tls": TLS_CLIENT,
    "auth": {"authenticator": None},
    "sending_queue": QUEUE,
    "retry_on_failure": RETRY,
}
COMPONENT_KEYS: dict[str, dict[str, Keys]] = {
    "extensions": {
        "file_storage": {
            **leaves("directory timeout fsync create_directory directory_permissions recreate"),
            "compaction": leaves(
                "directory on_start on_rebound rebound_needed_threshold_mib rebound_trigger_threshold_mib "
                "max_transaction_size check_interval cleanup_on_start"
            ),
        },
        "bearertokenauth": leaves("scheme header token tokens filename"),
    },
    "receivers": {"otlp": {"protocols": {"grpc": None, "http": None}}},
    "processors": {
        "memory_limiter": leaves(
            "check_interval limit_mib spike_limit_mib limit_percentage spike_limit_percentage "
            "min_gc_interval_when_soft_limited min_gc_interval_when_hard_limited"
        ),
        "batch": leaves(
            "timeout send_batch_size send_batch_max_size metadata_keys metadata_cardinality_limit"
        ),
    },
    "exporters": {
        "otlp_grpc": GRPC_EXPORTER,
        "debug": leaves("verbosity sampling_initial sampling_thereafter use_internal_logger"),
        "load_balancing": {
            **leaves("routing_key routing_attributes timeout"),
            "protocol": {"otlp": {key: keys for key, keys in GRPC_EXPORTER.items() if key != "endpoint"}},
            "resolver": {
                "static": {"hostnames": None},
                "dns": leaves("hostname port interval timeout"),
                "k8s": leaves("service ports timeout return_hostnames"),
                "aws_cloud_map": None,
            },
            "sending_queue": QUEUE,
            "retry_on_failure": RETRY,
        },
    },
}


def unknown_keys(settings: Any, keys: Keys, where: str) -> list[str]:
    """The settings under ``where`` that ``keys`` does not list, at any depth."""
    if not isinstance(settings, dict):
        return []
    found = []
    for key, value in settings.items():
        if key not in keys:
            found.append(f"{where}.{key}")
        elif keys[key] is not None:
            found.extend(unknown_keys(value, keys[key], f"{where}.{key}"))
    return found


def check_component_keys(config: dict[str, Any]) -> None:
    unknown = []
    for section, types in COMPONENT_KEYS.items():
        for name, settings in (config.get(section) or {}).items():
            kind = component_type(name)
            assert kind in types, f"{section}.{name}: no key list for {kind} here; add its settings"
            unknown.extend(unknown_keys(settings, types[kind], f"{section}.{name}"))
    assert not unknown, f"settings the Collector does not take: {unknown}"
    for name, settings in (config.get("exporters") or {}).items():
        if component_type(name) == "debug" and settings:
            assert settings.get("verbosity", "basic") in ("basic", "normal", "detailed"), name
        if component_type(name) == "load_balancing":
            assert settings["routing_key"] in (
                "traceID",
                "service",
                "resource",
                "metric",
                "streamID",
                "attributes",
            )


def collector_configs() -> list[tuple[str, dict[str, Any]]]:
    """otel-config.yaml with its commented setups in place, and every Collector
    configuration of docs/deployment.md (those with a ``service`` section)."""
    text = CONFIG.read_text()
    config = yaml.safe_load(text)
    config["exporters"].update(yaml.safe_load(commented_block(text, "load_balancing/durable_sessions:")))
    config["extensions"].update(yaml.safe_load(commented_block(text, "bearertokenauth/durable_sessions:")))
    config["exporters"]["otlp_grpc/durable_sessions"].update(yaml.safe_load(commented_block(text, "auth:")))
    found = [("otel-config.yaml", config)]
    for number, block in deployment_configs():
        if isinstance(block, dict) and "service" in block:
            found.append((f"docs/deployment.md yaml block {number}", block))
    return found


@pytest.mark.parametrize(
    ("where", "config"), collector_configs(), ids=[where for where, _ in collector_configs()]
)
def test_collector_configurations_use_only_settings_the_collector_takes(
    where: str, config: dict[str, Any]
) -> None:
    check_component_keys(config)


def test_a_misspelt_collector_setting_is_found() -> None:
    config = yaml.safe_load(CONFIG.read_text())
    config["extensions"]["file_storage/durable_sessions"]["compaction"]["on_startup"] = True
    config["exporters"]["otlp_grpc/durable_sessions"]["retry_on_failure"]["max_elapsed"] = 0
    with pytest.raises(AssertionError, match=r"compaction\.on_startup.*retry_on_failure\.max_elapsed"):
        check_component_keys(config)
