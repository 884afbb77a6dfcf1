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
