"""What the documentation says, checked against the code.

Covers README.md, docs/*.md, collector/README.md, otel-config.yaml and the Makefile:
relative links and anchors, the command lines and their options, the Python snippets,
the semantic-conventions example, documented defaults, messages and file paths. Each
test names the passage it holds to. The commands run in this process where they can
(``durable_sessions.cli.main``), so the whole file takes a few seconds.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import re
import shlex
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

from durable_sessions import cli
from durable_sessions.rules import CATALOGUE
from tests.support.rule_examples import unexpected_rules

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = ROOT / "docs"
COLLECTOR_README = ROOT / "collector" / "README.md"
MARKDOWN = [README, *sorted(DOCS.glob("*.md")), COLLECTOR_README]


def read(path: Path) -> str:
    return path.read_text(encoding="utf-8")


def without_code(text: str) -> str:
    """Markdown with its fenced code blocks removed (links and headings there are not real)."""
    return re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)


def code_blocks(text: str, *languages: str) -> list[str]:
    """The bodies of the fenced blocks whose info string is one of ``languages``."""
    found = []
    for match in re.finditer(r"^```([\w-]*)\n(.*?)^```", text, flags=re.S | re.M):
        if match.group(1) in languages:
            found.append(match.group(2))
    return found


def run_cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    """``durable-sessions ARGV`` in this process: (exit code, stdout, stderr)."""
    capsys.readouterr()
    try:
        code = cli.main(list(argv))
    except SystemExit as exit_:
        code = int(exit_.code or 0)
    out, err = capsys.readouterr()
    return code, out, err


def run_replay_check(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    capsys.readouterr()
    try:
        code = cli.replay_check_main(list(argv))
    except SystemExit as exit_:
        code = int(exit_.code or 0)
    out, err = capsys.readouterr()
    return code, out, err


def option_strings(parser: argparse.ArgumentParser) -> set[str]:
    return {
        option
        for action in parser._actions
        for option in action.option_strings
        if option.startswith("--") and option not in ("--help", "--version")
    }


def subparser(parser: argparse.ArgumentParser, name: str) -> argparse.ArgumentParser:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return action.choices[name]
    raise KeyError(name)


def choices_of(parser: argparse.ArgumentParser, option: str) -> tuple[str, ...]:
    for action in parser._actions:
        if option in action.option_strings:
            return tuple(action.choices or ())
    raise KeyError(option)


def default_of(parser: argparse.ArgumentParser, option: str) -> object:
    for action in parser._actions:
        if option in action.option_strings:
            return action.default
    raise KeyError(option)


# -- links and anchors ------------------------------------------------------------------


def github_slug(heading: str) -> str:
    """The anchor GitHub gives a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[`*_]|<[^>]+>", "", heading).strip().lower()
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", text)
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    text = read(path)
    found: set[str] = set(re.findall(r'<a (?:id|name)="([^"]+)"', text))
    seen: dict[str, int] = {}
    for match in re.finditer(r"^#{1,6}\s+(.+?)\s*#*\s*$", without_code(text), flags=re.M):
        slug = github_slug(match.group(1))
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        found.add(slug if count == 0 else f"{slug}-{count}")
    return found


def relative_links() -> Iterator[tuple[Path, str]]:
    for path in MARKDOWN:
        for match in re.finditer(r"\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)", without_code(read(path))):
            link = match.group(1)
            if not re.match(r"[a-z][a-z0-9+.-]*:", link):  # http:, https:, mailto:
                yield path, link


LINKS = list(relative_links())


def test_the_docs_have_relative_links() -> None:
    assert len(LINKS) > 20


@pytest.mark.parametrize(("doc", "link"), LINKS, ids=[f"{p.relative_to(ROOT)}->{link}" for p, link in LINKS])
def test_relative_link_and_anchor_resolve(doc: Path, link: str) -> None:
    target, _, fragment = link.partition("#")
    path = (doc.parent / target).resolve() if target else doc
    assert path.exists(), f"{doc.relative_to(ROOT)}: link target {target!r} does not exist"
    if fragment:
        assert path.suffix == ".md", f"{doc.relative_to(ROOT)}: anchor into a non-Markdown file {link!r}"
        assert fragment in anchors(path), (
            f"{doc.relative_to(ROOT)}: {link!r}: no heading or <a id> {fragment!r} in {path.name}"
        )


def test_cross_references_by_section_name_exist() -> None:
    """Prose references to sections ("see ... "Order"", "The SQLite store", ...)."""
    collector = read(COLLECTOR_README)
    assert "**Order.**" in collector  # docs/readers.md: see its README, "Order"
    assert "## The SQLite store" in collector  # docs/deployment.md
    assert "### OTLP log records" in collector  # docs/deployment.md


# -- files the docs name ----------------------------------------------------------------

DOCUMENTED_PATHS = sorted(
    {
        token
        for path in MARKDOWN
        for token in re.findall(r"`([A-Za-z0-9_][A-Za-z0-9_./-]*/[A-Za-z0-9_./-]*)`", read(path))
        if re.match(r"(benchmarks|collector|docs|examples|proto|src|tests)(/|$)", token)
    }
    | {"otel-config.yaml", "Makefile", "examples/demo.py", "examples/processor_quickstart.py"}
)


@pytest.mark.parametrize("name", DOCUMENTED_PATHS)
def test_documented_path_exists(name: str) -> None:
    candidates = [ROOT / name, ROOT / "collector" / name]
    assert any(c.exists() for c in candidates), f"the docs name {name!r}, which does not exist"


def test_benchmark_commands_use_existing_scripts_and_options() -> None:
    """docs/benchmarks.md: every ``.venv/bin/python benchmarks/X.py ...`` command."""
    commands = re.findall(
        r"^\.venv/bin/python (benchmarks/\S+\.py)(.*?)(?:#.*)?$", read(DOCS / "benchmarks.md"), re.M
    )
    assert len(commands) >= 8
    for script, args in commands:
        source = read(ROOT / script)
        for option in re.findall(r"(--[a-z][a-z-]*)", args):
            assert f'"{option}"' in source, f"{script} has no option {option}"
        for mode in re.findall(r"^\s*([a-z][a-z-]+)\b", args):
            assert f'"{mode}"' in source, f"{script} has no mode {mode}"


def test_benchmark_pages_command_runs_on_a_store_smaller_than_its_pages() -> None:
    """docs/benchmarks.md's ``collector_ingest.py pages`` command, with fewer sessions than
    documented: when the unrecoverable sessions fit on one page it crashed with
    ``StatisticsError: no median for empty data`` after filling the store."""
    small = ["--sessions", "300", "--pages", "3", "--page-size", "100"]
    completed = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "collector_ingest.py"), "pages", *small],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert completed.returncode == 0, completed.stderr
    assert "VERDICT_UNSPECIFIED: first page" in completed.stdout
    assert "VERDICT_UNRECOVERABLE: one page" in completed.stdout


def test_benchmark_store_floor_command_runs() -> None:
    """docs/benchmarks.md's ``collector_ingest.py store-floor`` command, on a few requests:
    it unpacked seven of the eight parts the decoder gives a span (the end time came later)
    and crashed with ``ValueError: too many values to unpack`` before measuring anything."""
    completed = subprocess.run(
        [
            sys.executable,
            str(ROOT / "benchmarks" / "collector_ingest.py"),
            "store-floor",
            "--requests",
            "2",
            "--rounds",
            "1",
        ],
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert completed.returncode == 0, completed.stderr
    assert re.search(
        r"median: discard [\d.]+ µs/span.*SQLite [\d.]+ µs/row as stored.*[\d.]+ µs/span packed",
        completed.stdout,
    )


def _providing_distribution(module: str) -> str | None:
    """The installed distribution whose files hold ``module`` (None: stdlib or not installed)."""
    import importlib.metadata
    import importlib.util

    spec = importlib.util.find_spec(module)
    if spec is None or spec.origin is None:
        return None
    origin = os.path.realpath(spec.origin)
    for name in importlib.metadata.packages_distributions().get(module.split(".")[0], ()):
        files = importlib.metadata.distribution(name).files or ()
        if any(os.path.realpath(f.locate()) == origin for f in files if f.name == Path(origin).name):
            return name
    return None


def test_what_the_examples_import_is_installed_by_the_readme_install_section() -> None:
    """README "Install": every third-party module ``examples/`` imports is a dependency of
    one of the two distributions or named there. The demo's agents import the SDK's
    OTLP/gRPC exporter, which only the test extras installed: after the two documented
    commands each agent failed with ModuleNotFoundError."""
    import ast
    import importlib.metadata

    def normal(name: str) -> str:
        return re.sub(r"[-_.]+", "-", name).lower()

    install = read(README).split("## Install", 1)[1].split("\n## ", 1)[0]
    named = {normal(d) for d in ("durable-sessions", "durable-sessions-collector")}
    for dist in ("durable-sessions", "durable-sessions-collector"):
        for requirement in importlib.metadata.requires(dist) or ():
            if "extra ==" not in requirement:
                named.add(normal(re.match(r"[A-Za-z0-9_.-]+", requirement).group()))
    modules = set()
    for path in (ROOT / "examples").rglob("*.py"):
        for node in ast.walk(ast.parse(read(path))):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                modules.add(node.module)
            elif isinstance(node, ast.Import):
                modules.update(alias.name for alias in node.names)
    missing = {}
    for module in sorted(modules - {"_common"}):
        dist = _providing_distribution(module)
        if dist is not None and normal(dist) not in named and dist not in install:
            missing[module] = dist
    assert not missing, missing


def test_make_targets_named_in_the_docs_exist() -> None:
    makefile = read(ROOT / "Makefile")
    named = set()
    for path in MARKDOWN:
        named |= {m for pair in re.findall(r"`make (\w+)`|^make (\w+)", read(path), re.M) for m in pair if m}
    assert {"demo", "test", "format", "proto"} <= named
    for target in named:
        assert re.search(rf"^{target}:", makefile, re.M), (
            f"make {target} is documented but not in the Makefile"
        )


@pytest.mark.parametrize(
    "name",
    [
        "durable_sessions.processor.DurabilitySpanProcessor",
        "durable_sessions.processor.ConfigurationError",
        "durable_sessions.processor.DurabilityViolationError",
        "durable_sessions.mapping.map_span",
        "durable_sessions.semconv",
        "durable_sessions.instrument.action",
        "durable_sessions.instrument.session",
        "durable_sessions.instrument.resource",
        "durable_sessions.instrument.idempotency_key",
        "durable_sessions.instrument.ResultStore",
        "durable_sessions.offload",
        "durable_sessions.pytest_plugin",
    ],
)
def test_documented_python_name_exists(name: str) -> None:
    module, _, attribute = name.rpartition(".")
    try:
        importlib.import_module(name)
    except ImportError:
        assert hasattr(importlib.import_module(module), attribute), name


# -- durable-sessions check / rules / explain / replay-check ---------------------------

PARSER = cli.build_parser()
CHECK = subparser(PARSER, "check")
RULES = subparser(PARSER, "rules")


def readme_block_line(prefix: str) -> str:
    """README's sh block text from the line starting with ``prefix`` up to the next command."""
    block = next(b for b in code_blocks(read(README), "sh") if prefix in b)
    lines = block.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(prefix))
    part = [lines[start]]
    for line in lines[start + 1 :]:
        if not line.startswith(" "):
            break
        part.append(line)
    return "\n".join(part)


README_CHECK = readme_block_line("durable-sessions check")


def test_readme_check_options_exist() -> None:
    """README, "The offline checker": every option it lists for ``check`` is in ``--help``."""
    listed = set(re.findall(r"--[a-z][a-z-]*", README_CHECK))
    assert listed, README_CHECK
    assert listed <= option_strings(CHECK), listed - option_strings(CHECK)


def test_every_check_option_is_in_the_readme_synopsis() -> None:
    """README's ``check`` synopsis lists every option ``--help`` has."""
    listed = set(re.findall(r"--[a-z][a-z-]*", README_CHECK))
    assert option_strings(CHECK) <= listed, (
        f"not in README's synopsis: {sorted(option_strings(CHECK) - listed)}"
    )


def test_every_check_option_is_documented_somewhere() -> None:
    text = read(README) + read(DOCS / "readers.md")
    for option in option_strings(CHECK):
        assert f"`{option}" in text or f"[{option}" in text, f"{option} is documented nowhere"


@pytest.mark.parametrize(
    ("option", "documented"),
    [("--format", "text|json|sarif"), ("--fail-on", "error|warning"), ("--rules", "seed|all")],
)
def test_readme_check_choices(option: str, documented: str) -> None:
    assert f"{option} {documented}" in README_CHECK
    assert set(choices_of(CHECK, option)) == set(documented.split("|"))


def test_readers_md_input_formats_and_defaults() -> None:
    readers = read(DOCS / "readers.md")
    assert "With `--input-format auto` (the default)" in readers
    assert default_of(CHECK, "--input-format") == "auto"
    assert "`--input-format actions`, `tracing` or `otlp-json`" in flat(readers)
    assert set(choices_of(CHECK, "--input-format")) == {"auto", "actions", "tracing", "otlp-json"}
    assert "`--max-line-bytes N` (default 64 MiB)" in readers
    assert default_of(CHECK, "--max-line-bytes") == 64 * 1024 * 1024


def test_check_key_window_default_matches_the_processor_docs() -> None:
    assert "| `key_window_s` | `DURABLE_SESSIONS_KEY_WINDOW_S` | `86400` |" in read(DOCS / "processor.md")
    assert default_of(CHECK, "--key-window-s") == 86400


def test_readme_rules_formats() -> None:
    line = readme_block_line("durable-sessions rules")
    assert "--format json|markdown" in line
    assert {"json", "markdown"} <= set(choices_of(RULES, "--format"))


def test_readme_replay_check_synopsis_matches_help() -> None:
    line = readme_block_line("replay-check").split("#")[0]
    assert re.findall(r"--[a-z]+", line) == ["--actions", "--strict", "--quiet"]
    source = Path(cli.__file__).read_text(encoding="utf-8")
    helped = set(re.findall(r'parser\.add_argument\("(--[a-z-]+)"', source.split("def build_parser")[0]))
    assert helped == {"--actions", "--strict", "--quiet"}


def test_readme_explain_example_prints_the_rules_md_section(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run_cli(capsys, "explain", "unkeyed-side-effect")
    assert code == 0
    assert out.startswith("# unkeyed-side-effect")
    code, _, err = run_cli(capsys, "explain", "no-such-rule")
    assert code == 2 and "unknown rule" in err


# -- exit codes and messages (README "Exit codes", docs/readers.md) ----------------------

GOOD = ROOT / "examples" / "logs" / "actions.good.jsonl"
BAD = ROOT / "examples" / "logs" / "actions.bad.jsonl"


def test_readme_exit_codes(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    readme = read(README)
    assert "Exit codes: `0` every action is replay-safe, `1` violations" in readme
    assert run_cli(capsys, "check", str(GOOD))[0] == 0
    assert run_cli(capsys, "check", str(BAD))[0] == 1
    code, _, err = run_cli(capsys, "check", str(tmp_path / "missing.jsonl"))
    assert code == 2 and "cannot read" in err
    assert run_cli(capsys, "check", "--disable", "no-such-rule", str(GOOD))[0] == 2
    assert run_replay_check(capsys, "--actions", str(GOOD))[0] == 0
    assert run_replay_check(capsys, "--actions", str(BAD))[0] == 1
    assert run_replay_check(capsys, "--actions", str(tmp_path / "missing.jsonl"))[0] == 2


def test_fail_on_warning(capsys: pytest.CaptureFixture[str]) -> None:
    warning_only = ROOT / "examples" / "rules" / "key-outlived-window.bad.jsonl"
    assert run_cli(capsys, "check", str(warning_only))[0] == 0
    assert run_cli(capsys, "check", "--fail-on", "warning", str(warning_only))[0] == 1


def test_readme_examples_rules_has_a_pair_for_every_rule() -> None:
    folder = ROOT / "examples" / "rules"
    for rule in CATALOGUE:
        assert (folder / f"{rule.id}.bad.jsonl").is_file(), rule.id
        assert (folder / f"{rule.id}.good.jsonl").is_file(), rule.id


def flat(text: str) -> str:
    """Text with every run of white space (line breaks included) as one space."""
    return " ".join(text.split())


def quoted(doc: Path, text: str) -> str:
    """``text``, after checking that ``doc`` still says it (wherever its lines break)."""
    assert flat(text) in flat(read(doc)), f"{doc.name} no longer quotes {text!r}; update this test"
    return text


def test_readers_md_quoted_messages(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    readers = DOCS / "readers.md"
    log = tmp_path / "session.jsonl"
    log.write_text(
        "# comment\n"
        "\n"
        '{"session_id":5,"action_id":"a1","kind":"tool_call","status":"ok"}\n'
        '{"session_id":"s","action_id":"a2","kind":"tool_call","status":"ok","retryable":"yes"}\n'
        + "[" * 1100
        + "]" * 1100
        + "\n"
        '{"session_id":"s","action_id":"a3","kind":"tool_call","status":"ok","retryable":true,'
        '"max_attempts":3,"attempts":1000000000000000000000000000000000000000}\n'
        "NaN\n",
        encoding="utf-8",
    )
    code, out, _ = run_cli(capsys, "check", str(log))
    assert code == 1
    for message in (
        "required field 'session_id' is the integer 5, expected a non-empty string",
        "retryable is the string 'yes', expected true or false",
        "line is JSON nested too deeply to read",
    ):
        assert quoted(readers, message) in out
    # physical line numbers: blank and comment lines count
    assert f"{log}:3: error[missing-field]" in out
    assert re.search(rf"{re.escape(str(log))}:7: error\[unreadable-line\]", out)


def test_readers_md_long_line_message(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    log = tmp_path / "long.jsonl"
    log.write_text(
        '{"session_id":"s","action_id":"a1","kind":"tool_call","status":"ok","pad":"' + "x" * 200 + '"}\n',
        encoding="utf-8",
    )
    _, out, _ = run_cli(capsys, "check", "--max-line-bytes", "100", str(log))
    assert quoted(DOCS / "readers.md", "the reader's limit") in out
    assert "line is longer than 100 bytes, the reader's limit" in out


def test_readers_md_several_files(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    readers = DOCS / "readers.md"
    monkeypatch.chdir(tmp_path)
    Path("run-1.jsonl").write_text(
        '{"session_id":"s","action_id":"a0","kind":"tool_call","status":"ok"}\n'
        '{"session_id":"s","action_id":"a1","kind":"tool_call","status":"ok"}\n',
        encoding="utf-8",
    )
    Path("run-2.jsonl").write_text(
        '{"session_id":"s","action_id":"a1","kind":"payment","status":"ok","idempotency_key":"k-1"}\n',
        encoding="utf-8",
    )
    _, out, _ = run_cli(capsys, "check", "run-1.jsonl", "run-2.jsonl")
    assert quoted(readers, "duplicate action_id 'a1' (first at run-1.jsonl:2") in out
    code, _, err = run_cli(capsys, "check", "run-1.jsonl", "run-3.jsonl")
    assert code == 2
    message = "durable-sessions check: cannot read 'run-3.jsonl': No such file or directory"
    assert quoted(readers, message) in err
    Path("empty.jsonl").write_text("# only a comment\n\n", encoding="utf-8")
    code, _, err = run_cli(capsys, "check", "empty.jsonl")
    assert code == 0
    assert quoted(readers, "warning: no actions found in the input") in err


def test_readers_md_tracing_demo_gets_three_unrecorded_results(capsys: pytest.CaptureFixture[str]) -> None:
    """docs/readers.md: "The seed's own demo-run-001.jsonl gets three such errors"."""
    quoted(DOCS / "readers.md", "gets three such errors, one per agent turn")
    _, out, _ = run_cli(
        capsys, "check", "--format", "json", str(ROOT / "tests/data/tracing-demo-run-001.jsonl")
    )
    rules = [v["rule"] for v in json.loads(out)["violations"]]
    assert rules == ["unrecorded-result"] * 3


OTLP_LINE = {
    "resourceSpans": [
        {
            "resource": {"attributes": []},
            "scopeSpans": [
                {
                    "spans": [
                        {
                            "traceId": "5b8efff798038103d269b633813fc60c",
                            "spanId": "eee19b7ec3c1b174",
                            "name": "payment a07",
                            "startTimeUnixNano": "1700000000000000000",
                            "attributes": [
                                {"key": "session.id", "value": {"stringValue": "trip-42"}},
                                {"key": "agent.action.id", "value": {"stringValue": "a07"}},
                                {"key": "agent.action.kind", "value": {"stringValue": "payment"}},
                            ],
                        }
                    ]
                }
            ],
        }
    ]
}


def test_readers_md_otlp_file_is_detected(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    path = tmp_path / "agent-traces.jsonl"
    path.write_text(json.dumps(OTLP_LINE) + "\n", encoding="utf-8")
    code, out, _ = run_cli(capsys, "check", str(path))
    assert code == 1
    assert f"{path}:1: error[unkeyed-side-effect] trip-42/a07" in out


def test_readers_md_otlp_violations_name_the_line_and_in_sarif_the_span(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """docs/readers.md, "OTLP/JSON trace files": violations name the file and line of the
    request; in SARIF output each result's fingerprint (the violation's key) also names the
    span id."""
    quoted(DOCS / "readers.md", "in SARIF output each")
    path = tmp_path / "agent-traces.jsonl"
    path.write_text(json.dumps(OTLP_LINE) + "\n", encoding="utf-8")
    _, text, _ = run_cli(capsys, "check", str(path))
    assert f"{path}:1" in text
    _, sarif, _ = run_cli(capsys, "check", "--format", "sarif", str(path))
    fingerprints = [
        result["partialFingerprints"]["durableSessionsViolation/v1"]
        for result in json.loads(sarif)["runs"][0]["results"]
    ]
    assert fingerprints and all(f.endswith("|eee19b7ec3c1b174") for f in fingerprints)


def test_readers_md_jobs_default_is_one_per_core_at_most_8(monkeypatch: pytest.MonkeyPatch) -> None:
    """README / docs/readers.md / ``--help``: one worker per core, at most 8, for over 64 MiB
    of JSONL input."""
    from durable_sessions import check

    quoted(DOCS / "readers.md", "at most 8, for more than 64 MiB")
    assert "one worker process per core (at most 8)" in read(README)
    assert check.PARALLEL_MIN_BYTES == 64 * 1024 * 1024
    monkeypatch.setattr(check.os.path, "getsize", lambda path: 100 * 1024 * 1024)
    monkeypatch.setattr(check, "usable_cores", lambda: 16)
    assert check.default_jobs(["big.jsonl"], "auto") == 8
    monkeypatch.setattr(check, "usable_cores", lambda: 2)
    assert check.default_jobs(["big.jsonl"], "auto") == 2


# -- docs/rules.md examples ----------------------------------------------------------------


def rule_examples() -> Iterator[tuple[str, str, str]]:
    text = read(DOCS / "rules.md")
    parts = re.split(r'<a id="([a-z-]+)"></a>', text)[1:]
    for rule_id, body in zip(parts[::2], parts[1::2], strict=True):
        for heading, label in (("## Example", "bad"), ("## Use instead", "good")):
            match = re.search(rf"{heading}\n\n```json\n(.*?)```", body, re.S)
            if match:
                yield rule_id, label, match.group(1)


RULE_EXAMPLES = list(rule_examples())


def test_rules_md_has_json_examples() -> None:
    assert len(RULE_EXAMPLES) >= 40


@pytest.mark.parametrize(
    ("rule_id", "label", "body"), RULE_EXAMPLES, ids=[f"{r}-{lbl}" for r, lbl, _ in RULE_EXAMPLES]
)
def test_rules_md_example(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, rule_id: str, label: str, body: str
) -> None:
    """docs/rules.md: each "Example" breaks its rule and no other, each "Use instead" is clean."""
    path = tmp_path / "example.jsonl"
    path.write_text(body, encoding="utf-8")
    _, out, _ = run_cli(capsys, "check", "--strict", "--format", "json", str(path))
    rules = {v["rule"] for v in json.loads(out)["violations"]}
    if label == "bad":
        assert rule_id in rules
        assert not unexpected_rules(rule_id, rules), rules
    else:
        assert rules == set()


# -- docs/processor.md and README: the span processor -----------------------------------

PROCESSOR_MD = read(DOCS / "processor.md")
PROCESSOR_SNIPPETS = code_blocks(PROCESSOR_MD, "python")


def test_readme_five_lines_are_processor_md_first_snippet() -> None:
    readme_snippet = next(b for b in code_blocks(read(README), "python") if "DurabilitySpanProcessor" in b)
    assert readme_snippet == PROCESSOR_SNIPPETS[0]


def test_processor_md_snippets_run(tmp_path: Path) -> None:
    """The first two snippets of docs/processor.md, run as written after a preamble that
    supplies what they assume (a configured SDK provider; ``ask``, ``charge``, ``card``)."""
    add_processor, instrumentation = PROCESSOR_SNIPPETS[0], PROCESSOR_SNIPPETS[1]
    script = tmp_path / "snippets.py"
    script.write_text(
        textwrap.dedent(
            """\
            from opentelemetry import trace as _trace
            from opentelemetry.sdk.trace import TracerProvider as _TracerProvider

            _trace.set_tracer_provider(_TracerProvider())
            """
        )
        + add_processor
        + textwrap.dedent(
            """
            def ask(question):
                return {"budget_gbp": 2400}


            def charge(card, amount):
                return {"charge": "ch_1", "amount": amount}


            card = "tok_visa"
            """
        )
        + instrumentation
        + textwrap.dedent(
            """
            weather("kyoto")
            found = []
            for processor in _trace.get_tracer_provider()._active_span_processor._span_processors:
                processor.force_flush()
                found.append(processor.violations_reported)
            print("violations", sum(found))
            """
        ),
        encoding="utf-8",
    )
    result = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, cwd=tmp_path, timeout=60
    )
    assert result.returncode == 0, result.stderr
    assert "violations 0" in result.stdout, result.stdout + result.stderr


def test_processor_md_instrumentation_snippet_emits_on_the_provider_it_makes(tmp_path: Path) -> None:
    """Run alone, as a new script would: the snippet's spans reach the provider it builds,
    with the resource it gives it, not the API's no-op default."""
    script = tmp_path / "instrumentation.py"
    script.write_text(
        textwrap.dedent(
            """\
            def ask(question):
                return {"budget_gbp": 2400}


            def charge(card, amount):
                return {"charge": "ch_1", "amount": amount}


            card = "tok_visa"
            """
        )
        + PROCESSOR_SNIPPETS[1]
        + textwrap.dedent(
            """
            from opentelemetry.sdk.trace.export import SimpleSpanProcessor
            from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

            exporter = InMemorySpanExporter()
            provider.add_span_processor(SimpleSpanProcessor(exporter))
            weather("kyoto")
            for span in exporter.get_finished_spans():
                print(span.attributes["agent.action.id"], span.resource.attributes["service.name"])
            """
        ),
        encoding="utf-8",
    )
    result = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, cwd=tmp_path, timeout=60
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.split("\n") == ["weather-kyoto travel-agent", ""], result.stdout + result.stderr


def run_pytest(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:randomly", *args],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=60,
    )


PLUGIN_CONFTEST = textwrap.dedent(
    """\
    from opentelemetry import trace
    from opentelemetry.sdk.trace import TracerProvider

    from durable_sessions.instrument import action, session

    trace.set_tracer_provider(TracerProvider())


    def unkeyed_payment():
        with session("trip-42"), action("a07", "payment"):
            pass
    """
)


def test_processor_md_pytest_plugin_snippet(tmp_path: Path) -> None:
    snippet = PROCESSOR_SNIPPETS[2]
    (tmp_path / "conftest.py").write_text(PLUGIN_CONFTEST, encoding="utf-8")
    (tmp_path / "test_snippet.py").write_text(
        "from conftest import unkeyed_payment as run_agent\n\n\n" + snippet, encoding="utf-8"
    )
    result = run_pytest(tmp_path)
    assert result.returncode == 1, result.stdout
    assert "unkeyed-side-effect" in result.stdout


def test_processor_md_pytest_plugin_off_disables_it(tmp_path: Path) -> None:
    """docs/processor.md: "`report` (default) only collects; `off` disables it": the
    ``durability`` fixture collects nothing."""
    assert "`off` disables it" in PROCESSOR_MD
    (tmp_path / "conftest.py").write_text(PLUGIN_CONFTEST, encoding="utf-8")
    (tmp_path / "test_off.py").write_text(
        textwrap.dedent(
            """\
            from conftest import unkeyed_payment


            def test_off(durability):
                unkeyed_payment()
                assert durability.finish() == []
            """
        ),
        encoding="utf-8",
    )
    result = run_pytest(tmp_path, "--durability=off")
    assert result.returncode == 0, result.stdout


def processor_table() -> list[tuple[str, str, str]]:
    section = PROCESSOR_MD.split("## Configuration", 1)[1].split("\n## ", 1)[0]
    rows = []
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 3 and cells[0].startswith("`") and cells[1].startswith("`DURABLE"):
            rows.append((cells[0].strip("`"), cells[1].split("`")[1], cells[2].strip("`")))
    return rows


def test_processor_md_configuration_table(monkeypatch: pytest.MonkeyPatch) -> None:
    import inspect

    from durable_sessions import processor as module
    from durable_sessions.processor import DurabilitySpanProcessor

    rows = processor_table()
    assert {row[0] for row in rows} >= {
        "mode",
        "preset",
        "strict",
        "disable",
        "max_sessions",
        "key_window_s",
        "log_limit_per_minute",
        "checking",
    }
    parameters = inspect.signature(DurabilitySpanProcessor).parameters
    source = Path(module.__file__).read_text(encoding="utf-8")
    for argument, variable, _ in rows:
        assert argument in parameters, argument
        assert f'"{variable}"' in source, variable
    objects = ("rules", "on_violation", "meter_provider")  # a value no variable can hold
    for name in objects:
        assert name in parameters
    assert {row[0] for row in rows} == set(parameters) - set(objects), "every setting has its variable"
    for variable in list(__import__("os").environ):
        if variable.startswith("DURABLE_SESSIONS_"):
            monkeypatch.delenv(variable)
    built = DurabilitySpanProcessor()
    try:
        defaults = {row[0]: row[2] for row in rows}
        assert built.mode == defaults["mode"] == "log"
        assert built.checking == defaults["checking"] == "inline"
        assert built.checker is not None
        assert built.checker.max_sessions == int(defaults["max_sessions"])
        assert built.checker.key_window_s == int(defaults["key_window_s"])
        assert built._log._limit == int(defaults["log_limit_per_minute"])
        assert defaults["strict"] == "false" and defaults["preset"] == "all"
        assert not any(rule.id == "dead-end" for rule in built.checker.rules)
        assert {rule.id for rule in built.checker.rules} == {r.id for r in CATALOGUE if not r.strict_only}
    finally:
        built.shutdown()


@pytest.mark.parametrize(
    ("kwargs", "env"),
    [
        ({"mode": "loud"}, {}),
        ({"disable": ["no-such-rule"]}, {}),
        ({"max_sessions": 0}, {}),
        ({}, {"DURABLE_SESSIONS_MAX_SESSIONS": "many"}),
    ],
)
def test_processor_md_unusable_values_raise(
    monkeypatch: pytest.MonkeyPatch, kwargs: dict[str, object], env: dict[str, str]
) -> None:
    """docs/processor.md: "an unknown mode or rule id, `max_sessions=0`,
    `DURABLE_SESSIONS_MAX_SESSIONS=many`" raise ``ConfigurationError``."""
    from durable_sessions.processor import ConfigurationError, DurabilitySpanProcessor

    for key, value in env.items():
        monkeypatch.setenv(key, value)
    with pytest.raises(ConfigurationError):
        DurabilitySpanProcessor(**kwargs)  # type: ignore[arg-type]


def test_processor_md_numbers() -> None:
    from durable_sessions import instrument, offload, semconv

    assert "the queue holds at most 65,536 spans (and, with the native sender, 16 MiB)" in PROCESSOR_MD
    assert offload.DEFAULT_QUEUE_LIMIT == 65_536
    assert offload.DEFAULT_QUEUE_LIMIT * offload.NATIVE_BYTES_PER_SPAN == 16 * 1024 * 1024
    assert "`max_result_chars` (32 KiB)" in PROCESSOR_MD
    assert instrument.DEFAULT_MAX_RESULT_CHARS == 32 * 1024
    assert "`.durable_sessions/results`" in PROCESSOR_MD
    assert "`.durable_sessions/results`" in Path(instrument.__file__).read_text(encoding="utf-8")
    assert "counter `durable_sessions.violations`" in PROCESSOR_MD
    assert semconv.METRIC_VIOLATIONS == "durable_sessions.violations"


def test_processor_md_idempotency_key_signature() -> None:
    """docs/processor.md: ``idempotency_key(session_id, action_id, *, scope="")``: ``scope``
    is keyword-only."""
    from durable_sessions.instrument import idempotency_key

    assert '`idempotency_key(session_id, action_id, *, scope="")`' in PROCESSOR_MD
    key = idempotency_key("trip-42", "a07")
    assert re.fullmatch(r"ds1-[a-z2-7]{32}", key)
    assert idempotency_key("trip-42", "a07", scope="refund") != key
    with pytest.raises(TypeError):
        idempotency_key("trip-42", "a07", "refund")  # type: ignore[misc]


# -- docs/semconv.md ---------------------------------------------------------------------

SEMCONV_MD = read(DOCS / "semconv.md")


def test_semconv_md_example_span_is_the_record() -> None:
    from durable_sessions.mapping import SpanData, map_span

    section = SEMCONV_MD.split("## Example span", 1)[1]
    span_text = code_blocks(section, "")[0]
    expected = json.loads(code_blocks(section, "json")[0])
    resource_line = re.search(r"^resource: (.*)$", span_text, re.M).group(1)  # type: ignore[union-attr]
    resource = dict(part.strip().split("=", 1) for part in resource_line.split(","))
    attributes = {key: json.loads(value) for key, value in re.findall(r"^  (\S+)\s+= (.*)$", span_text, re.M)}
    assert "status: UNSET" in span_text
    span = SpanData(
        name=re.search(r"^name: (.*)$", span_text, re.M).group(1),  # type: ignore[union-attr]
        attributes=attributes,
        resource=resource,
        status_error=False,
        start_time_ns=expected["seq"],
        trace_id="5b8efff798038103d269b633813fc60c",
        span_id="eee19b7ec3c1b174",
    )
    mapped = map_span(span)
    assert mapped is not None
    assert dict(mapped.record) == expected


def test_semconv_md_attribute_table_matches_semconv_module() -> None:
    from durable_sessions import semconv

    table = dict(re.findall(r"^\| `(agent\.action\.[a-z_]+)` \| `([a-z_]+)` \|", SEMCONV_MD, re.M))
    assert table == semconv.ACTION_ATTRIBUTES
    sessions = re.search(r"^\| `session_id` \| (.*?) \|", SEMCONV_MD, re.M).group(1)  # type: ignore[union-attr]
    assert re.findall(r"span `([^`]+)`|; `([^`]+)`", sessions)
    listed = [a or b for a, b in re.findall(r"span `([^`]+)`|; `([^`]+)`", sessions)]
    assert tuple(listed) == semconv.SESSION_ATTRIBUTES
    assert "falls back to `gen_ai.tool.name`, `tool.name`, `gen_ai.request.model`" in SEMCONV_MD
    assert semconv.NAME_FALLBACKS == ("gen_ai.tool.name", "tool.name", "gen_ai.request.model")


@pytest.mark.parametrize(
    ("attributes", "kind"),
    [
        ({"gen_ai.operation.name": "chat"}, "llm_call"),
        ({"gen_ai.operation.name": "execute_tool"}, "tool_call"),
        ({"gen_ai.operation.name": "retrieval"}, "external_read"),
        ({"gen_ai.operation.name": "invoke_agent"}, None),
        ({"gen_ai.system": "openai", "gen_ai.request.model": "m"}, "llm_call"),
        ({"openinference.span.kind": "LLM"}, "llm_call"),
        ({"openinference.span.kind": "TOOL"}, "tool_call"),
        ({"openinference.span.kind": "RETRIEVER"}, "external_read"),
        ({"openinference.span.kind": "CHAIN"}, None),
        ({"traceloop.span.kind": "tool"}, "tool_call"),
        ({"traceloop.span.kind": "workflow"}, None),
        ({"http.method": "GET"}, None),
    ],
)
def test_semconv_md_conventions_table(attributes: dict[str, str], kind: str | None) -> None:
    from durable_sessions.mapping import map_attributes

    mapped = map_attributes(attributes, {}, False, 1, 1, 1, None, True)
    assert (mapped[0]["kind"] if mapped else None) == kind


def test_semconv_md_conventions_are_tried_in_the_documented_order() -> None:
    """docs/semconv.md: ``gen_ai.operation.name``, then OpenInference, then OpenLLMetry, and
    only then the GenAI form without an operation name (``gen_ai.system`` with
    ``gen_ai.request.model``)."""
    from durable_sessions.mapping import map_attributes

    assert "and only then the GenAI form" in SEMCONV_MD
    model = {"gen_ai.system": "openai", "gen_ai.request.model": "m"}
    alone = map_attributes(model, {}, False, 1, 1, 1, None, True)
    assert alone is not None and alone[0]["kind"] == "llm_call"
    assert map_attributes({**model, "traceloop.span.kind": "task"}, {}, False, 1, 1, 1, None, True) is None
    operation = {**model, "gen_ai.operation.name": "execute_tool", "traceloop.span.kind": "task"}
    first = map_attributes(operation, {}, False, 1, 1, 1, None, True)
    assert first is not None and first[0]["kind"] == "tool_call"


# -- the sidecar's command line and configuration ---------------------------------------


def collector_parser() -> argparse.ArgumentParser:
    from durable_sessions_collector import cli as collector_cli

    return collector_cli._parser()


def documented_collector_commands() -> Iterator[tuple[str, str]]:
    for path in (README, COLLECTOR_README, DOCS / "deployment.md"):
        for block in code_blocks(read(path), "sh"):
            for line in block.splitlines():
                line = line.split("#", 1)[0].strip()
                if line.startswith("durable-sessions-collector "):
                    yield str(path.relative_to(ROOT)), line


def expand_optional(line: str) -> str:
    """``[--verdict ok|at_risk|unrecoverable]`` -> ``--verdict ok``; ``[--limit N]`` -> ``--limit 5``."""

    def one(match: re.Match[str]) -> str:
        words = match.group(1).split()
        if len(words) > 1:
            words[1] = words[1].split("|")[0].replace("N", "5") if words[1] == "N" else words[1].split("|")[0]
        return " ".join(words)

    return re.sub(r"\[([^\]]+)\]", one, line)


COLLECTOR_COMMANDS = sorted(set(documented_collector_commands()))


@pytest.mark.parametrize(("doc", "line"), COLLECTOR_COMMANDS, ids=[line for _, line in COLLECTOR_COMMANDS])
def test_documented_collector_command_parses(doc: str, line: str) -> None:
    """Every ``durable-sessions-collector`` command line in the docs is accepted as written
    (``--json`` is an option of ``sessions``, before ``list``/``show``)."""
    argv = shlex.split(expand_optional(line))[1:]
    argv = ["trip-42" if a == "SESSION_ID" else a for a in argv]
    parser = collector_parser()
    try:
        parser.parse_args(argv)
    except SystemExit as exit_:
        pytest.fail(f"{doc}: {line!r} is rejected by the parser (exit {exit_.code})")


def test_every_documented_install_of_the_sidecar_installs_the_library_first() -> None:
    """The sidecar requires durable-sessions of its own release, which pip finds only in
    the repository: ``pip install -e ./collector`` alone fails ('No matching distribution
    found for durable-sessions==…'), so each block that installs it installs the library
    before it, or in the same command."""
    alone = []
    for path in MARKDOWN:
        for block in code_blocks(read(path), "sh", "console"):
            library = False
            for line in block.splitlines():
                words = line.split("#", 1)[0].split()
                if "pip" not in words or "install" not in words:
                    continue
                library = library or "." in words
                if any(word.strip("'\"").startswith("./collector") for word in words) and not library:
                    alone.append(f"{path.relative_to(ROOT)}: {line.strip()}")
    assert not alone, alone


def test_collector_readme_sessions_options() -> None:
    sessions = subparser(collector_parser(), "sessions")
    section = read(COLLECTOR_README).split("## CLI: sessions", 1)[1].split("\nMetrics", 1)[0]
    for option in ("--endpoint", "--token", "--token-file", "--ca-file"):
        assert f"`{option}`" in section
        assert option in option_strings(sessions)
    assert "default `http://127.0.0.1:4320`" in section
    listing = subparser(sessions, "list")
    for option in ("--endpoint", "--token", "--token-file", "--ca-file", "--json"):  # "before or after"
        assert option in option_strings(listing) and option in option_strings(subparser(sessions, "show"))
    assert set(choices_of(listing, "--verdict")) == {"ok", "at_risk", "unrecoverable"}


def test_store_urls_in_docs_are_absolute_where_meant() -> None:
    """``sqlite:///PATH`` is relative, ``sqlite:////abs/path`` absolute (collector/README.md):
    every example that means /var/lib uses four slashes."""
    from durable_sessions_collector.config import load

    assert load(env={}, overrides={"store": "sqlite:///rel.db"}).store_path == "rel.db"
    assert load(env={}, overrides={"store": "sqlite:////abs.db"}).store_path == "/abs.db"
    offending = []
    for path in [*MARKDOWN, ROOT / "otel-config.yaml"]:
        for url in re.findall(r"sqlite:///[^\s`'\"]+", read(path)):
            if re.match(r"sqlite:///(var|etc|srv|opt|tmp|home|data)/", url):
                offending.append(f"{path.relative_to(ROOT)}: {url}")
    assert not offending, offending


def test_otel_config_exporter_timeout_exceeds_ack_timeout() -> None:
    """docs/deployment.md: keep the exporter's ``timeout`` above ``pipeline.ack_timeout_s``."""
    import yaml
    from durable_sessions_collector.config import load

    config = yaml.safe_load(read(ROOT / "otel-config.yaml"))
    exporter = config["exporters"]["otlp_grpc/durable_sessions"]
    assert float(exporter["timeout"].rstrip("s")) > load(env={}).pipeline_ack_timeout_s == 5.0
    assert exporter["retry_on_failure"]["max_elapsed_time"] == 0
    assert exporter["sending_queue"]["storage"] in config["service"]["extensions"]
    assert exporter["endpoint"] == "127.0.0.1:4319"
    assert config["receivers"]["otlp"]["protocols"]["grpc"]["endpoint"].endswith(":4317")
    assert config["receivers"]["otlp"]["protocols"]["http"]["endpoint"].endswith(":4318")
    assert config["service"]["pipelines"]["traces"]["exporters"] == ["otlp_grpc/durable_sessions", "debug"]


def test_sidecar_default_ports_match_the_docs() -> None:
    from durable_sessions_collector.config import load

    defaults = load(env={})
    assert defaults.receivers_grpc_endpoint == "127.0.0.1:4319"
    assert defaults.receivers_http_endpoint == "127.0.0.1:4320"
    assert defaults.store == "sqlite:///durable-sessions.db"  # relative: in the current directory
    assert "OTLP gRPC 127.0.0.1:4319, HTTP 127.0.0.1:4320, SQLite ./durable-sessions.db" in read(README)


def test_the_collector_readme_table_is_what_config_reference_prints() -> None:
    # "config-reference   # the table below": the table had drifted (the auth.token row, and
    # three boolean flags shown without the value they need).
    from durable_sessions_collector.config import reference

    assert reference() in read(COLLECTOR_README)


RECOVERY_MD = ROOT / "docs" / "recovery.md"


def test_recovery_md_first_snippet_asks_once_and_charges_once_over_two_runs(tmp_path: Path) -> None:
    """The journal snippet of docs/recovery.md, run twice as written: the second run replays."""
    script = tmp_path / "snippet.py"
    script.write_text(code_blocks(read(RECOVERY_MD), "python")[0], encoding="utf-8")
    runs = [
        subprocess.run(
            [sys.executable, str(script)],
            input="2400\n",
            capture_output=True,
            text=True,
            cwd=tmp_path,
            timeout=60,
        )
        for _ in range(2)
    ]
    assert [run.returncode for run in runs] == [0, 0], runs[-1].stderr
    assert runs[0].stdout == "Budget? " and runs[1].stdout == ""  # asked once only

    from durable_sessions.journal import SqliteJournal

    entries = SqliteJournal(tmp_path / "state" / "journal.db").entries("trip-42")
    assert [(e.action_id, e.status, e.outcome) for e in entries] == [
        ("a01", "ok", "2400"),
        ("a04", "ok", {"charged": 2400}),
    ]


def test_recovery_md_harness_snippet_makes_an_agent_the_harness_can_prove(tmp_path: Path) -> None:
    """The page's set-up for an agent under ``durable-sessions prove``, as written, plus two
    actions: every crash point resumes; without its journal line, the proof fails."""
    from durable_sessions.harness import describe, prove

    setup = code_blocks(read(RECOVERY_MD), "python")[2]
    body = textwrap.dedent(
        """
        from durable_sessions.instrument import action, session

        with session("trip-42", journal=journal):
            action("a01", "user_prompt")(lambda: "2400")()
            action("a02", "payment", idempotency_key="k-a02")(lambda: "paid")()
        """
    )
    agent = tmp_path / "agent.py"
    agent.write_text(setup + body, encoding="utf-8")
    proof = prove([sys.executable, str(agent)], tmp_path / "proof")
    assert proof.passed and len(proof.trials) == 4, "\n".join(describe(proof))
    agent.write_text(setup + body.replace("journal=journal", "journal=None"), encoding="utf-8")
    assert not prove([sys.executable, str(agent)], tmp_path / "no-journal").passed


def test_recovery_md_test_snippet_passes_as_a_test(tmp_path: Path) -> None:
    """The page's pytest example, collected and run by pytest from the repository root."""
    test_file = tmp_path / "test_resume.py"
    test_file.write_text(code_blocks(read(RECOVERY_MD), "python")[3], encoding="utf-8")
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(test_file)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0 and "1 passed" in done.stdout, done.stdout + done.stderr


def test_recovery_md_prove_options_are_the_commands_with_its_defaults() -> None:
    """docs/recovery.md's table of `prove` options: every option `prove --help` has, and
    no other, each numeric default as the parser has it."""
    rows = re.findall(r"^\| `(--[a-z-]+)[^`]*` \| (.*) \|$", read(RECOVERY_MD), flags=re.M)
    prove = subparser(cli.build_parser(), "prove")
    assert {option for option, _ in rows} == option_strings(prove)
    for option, meaning in rows:
        stated = re.search(r"\(default: (\d+)\)", meaning)
        if stated:
            assert default_of(prove, option) == int(stated.group(1)), option


def test_readers_md_field_table_names_every_field_the_checker_reads() -> None:
    """docs/readers.md, "Fields": a field the rules read, or `invalid-field` checks the type
    of, is in the table, since "fields not in the table are allowed and ignored" (a
    `cache_hit` of "yes" is not, nor a `value_limit` equal to `result_length`)."""
    from durable_sessions.rules.record_rules import _FIELD_SPECS

    section = read(DOCS / "readers.md").split("### Fields", 1)[1].split("\n#", 1)[0]
    documented = {
        name
        for row in section.splitlines()
        if row.startswith("| `")
        for name in re.findall(r"`(\w+)`", row.split("|")[1])
    }
    internal = {"mapping_problems"}  # set by the span mapping only; a log's is not honoured
    read_by_rules = {name for rule in CATALOGUE for name in rule.fields}
    assert (set(_FIELD_SPECS) | read_by_rules) - internal <= documented


def test_the_otlp_alert_attributes_are_the_ones_the_docs_list() -> None:
    """docs/deployment.md ("Alerts as OTLP log records") and collector/README.md ("OTLP
    log records") list the attributes of an alert's log record: every one it has."""
    from durable_sessions_collector.alerts.otlp import log_record

    payload = {
        "key": "k",
        "rule": "unkeyed-side-effect",
        "severity": "error",
        "session_id": "trip-42",
        "action_id": "a07",
        "message": "m",
        "session_verdict": "unrecoverable",
        "detected_at": 1.0,
        "status": "firing",
    }
    names = {attribute.key for attribute in log_record(payload).attributes}
    assert len(names) >= 8
    deployment = flat(read(DOCS / "deployment.md")).split("### Alerts as OTLP log records", 1)[1]
    listed = deployment.split("Each record has", 1)[1].split("so a backend links", 1)[0]
    readme_table = read(COLLECTOR_README).split("### OTLP log records", 1)[1].split("\n- ", 1)[0]
    for name in names:
        assert f"`{name}`" in listed, f"deployment.md does not list {name}"
        assert f"`{name}`" in readme_table, f"collector/README.md does not list {name}"
