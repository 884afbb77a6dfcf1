"""The two distributions as pip sees them: the metadata and sdists that setuptools' own
PEP 517 hooks make from ``pyproject.toml`` and ``setup.py``, built here from the
repository (into a temporary directory, leaving the tree as it was)."""

from __future__ import annotations

import email.parser
import os
import re
import subprocess
import sys
import tarfile
import textwrap
import zipfile
from email.message import Message
from pathlib import Path

from packaging.requirements import Requirement
from packaging.version import Version

import durable_sessions

ROOT = Path(__file__).resolve().parents[1]
LIBRARY = ROOT
COLLECTOR = ROOT / "collector"


def build_hook(project: Path, hook: str, out: Path, env: dict[str, str] | None = None) -> Path:
    """Run setuptools' ``hook`` (``prepare_metadata_for_build_wheel``, ``build_sdist``,
    ``build_wheel``) in ``project`` as a build frontend does, in a process of its own
    (with ``env`` for its environment), and return what it made in ``out``."""
    out.mkdir()
    code = textwrap.dedent(
        f"""\
        import sys
        from setuptools import build_meta
        print(build_meta.{hook}(sys.argv[1]))
        """
    )
    result = subprocess.run(
        [sys.executable, "-c", code, str(out)],
        cwd=project,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    return out / result.stdout.strip().splitlines()[-1]


def metadata(project: Path, tmp_path: Path) -> Message:
    dist_info = build_hook(project, "prepare_metadata_for_build_wheel", tmp_path / "metadata")
    return email.parser.Parser().parsestr((dist_info / "METADATA").read_text(encoding="utf-8"))


def test_the_collector_requires_the_library_release_it_was_made_with(tmp_path: Path) -> None:
    """The sidecar imports the library's internals (mapping, engine, rules), which change
    between releases: a collector installed beside another release of the library would
    judge spans with rules and a mapping it was not made for."""
    collector = metadata(COLLECTOR, tmp_path)
    assert collector["Version"] == durable_sessions.__version__
    (requirement,) = [
        Requirement(line)
        for line in collector.get_all("Requires-Dist")
        if Requirement(line).name == "durable-sessions"
    ]
    ours = Version(durable_sessions.__version__)
    assert requirement.specifier.contains(ours), requirement
    later = [
        Version(f"{ours.major}.{ours.minor}.{ours.micro + 1}"),
        Version(f"{ours.major}.{ours.minor + 1}"),
    ]
    earlier = Version(f"{ours.major}.{ours.minor}.{ours.micro}.dev0")
    for other in [*later, earlier]:
        assert not requirement.specifier.contains(other, prereleases=True), (requirement, other)


def test_each_distribution_describes_itself_with_its_readme(tmp_path: Path) -> None:
    """What an index shows on the project's page: the README beside its pyproject.toml."""
    for project in (LIBRARY, COLLECTOR):
        (tmp_path / project.name).mkdir()
        description = metadata(project, tmp_path / project.name)
        assert description["Description-Content-Type"] == "text/markdown", project
        readme = (project / "README.md").read_text(encoding="utf-8")
        assert description.get_payload().strip() == readme.strip(), project


def test_the_collector_description_links_only_what_its_index_page_can_follow(tmp_path: Path) -> None:
    """The collector's README is its description on the package index, where a link
    relative to the repository (``../docs/semconv.md``) leads to no page: it names such a
    file by its path in the repository, as it does ``docs/deployment.md``, and links only
    to web pages and to its own headings."""
    description = metadata(COLLECTOR, tmp_path).get_payload()
    targets = re.findall(r"\]\(\s*<?([^)\s>]+)", description)  # inline links: [text](target)
    assert targets
    assert [target for target in targets if not target.startswith(("https://", "http://", "#"))] == []


def sdist_members(project: Path, tmp_path: Path) -> set[str]:
    """The sdist's files, by their path in the project (without the ``NAME-VERSION/``
    directory they are packed under)."""
    with tarfile.open(build_hook(project, "build_sdist", tmp_path / "sdist")) as sdist:
        return {member.name.split("/", 1)[1] for member in sdist.getmembers() if member.isfile()}


def test_each_sdist_carries_what_builds_it_and_no_half_of_the_tests(tmp_path: Path) -> None:
    """An sdist builds the optional C extensions where a compiler is present, so it
    carries their sources and ``setup.py``. The tests need the repository around them
    (their support modules and data, the examples, the docs, the seed fixtures): an
    sdist with some of them would give whoever runs its tests import errors, not tests."""
    for project in (LIBRARY, COLLECTOR):
        (tmp_path / project.name).mkdir()
        members = sdist_members(project, tmp_path / project.name)
        sources = {str(path.relative_to(project)) for path in (project / "src").rglob("*.c")}
        assert sources, project
        assert {"pyproject.toml", "setup.py", "README.md", *sources} <= members, project
        assert not [name for name in members if name.startswith("tests/")], project


def unpacked_sdist(project: Path, tmp_path: Path) -> Path:
    """``project``'s sdist, unpacked in ``tmp_path``: the directory it packs everything under."""
    with tarfile.open(build_hook(project, "build_sdist", tmp_path / "sdist")) as sdist:
        sdist.extractall(tmp_path / "unpacked", filter="data")
    (source,) = (tmp_path / "unpacked").iterdir()
    return source


def wheel_without_a_compiler(project: Path, tmp_path: Path) -> Path:
    """The wheel pip builds from ``project``'s sdist where no C compiler runs (``CC=false``)."""
    source = unpacked_sdist(project, tmp_path)
    return build_hook(source, "build_wheel", tmp_path / "wheel", env={**os.environ, "CC": "false"})


NO_COMPILER_SCRIPT = textwrap.dedent(
    """\
    import sys
    sys.path.insert(0, sys.argv[1])
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
    from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue
    from opentelemetry.sdk.trace import TracerProvider

    from durable_sessions.cli import main
    from durable_sessions.native import native_module
    from durable_sessions.processor import DurabilitySpanProcessor
    from durable_sessions_collector.otlp.decode import protobuf_span_parts, wire_in_use

    print(
        "extensions",
        [native_module(name) for name in ("_native", "_engine", "_memory", "_mapping")],
        wire_in_use(),
    )

    found = []
    processor = DurabilitySpanProcessor(checking="process", mode="silent", on_violation=found.append)
    provider = TracerProvider()
    provider.add_span_processor(processor)
    attributes = {"session.id": "s", "agent.action.id": "p1", "agent.action.kind": "payment"}
    with provider.get_tracer("t").start_as_current_span("pay", attributes=attributes):
        pass
    processor.force_flush(20_000)
    print("processor", processor.checking, [v.rule for v in found], processor.internal_errors)
    provider.shutdown()

    request = ExportTraceServiceRequest()
    span = request.resource_spans.add().scope_spans.add().spans.add()
    span.trace_id, span.span_id, span.name = b"\\1" * 16, b"\\2" * 8, "pay"
    span.attributes.append(KeyValue(key="agent.action.id", value=AnyValue(string_value="p1")))
    print("decoded", len(protobuf_span_parts(request.SerializeToString(), [])))

    sys.argv = ["durable-sessions", "check", *sys.argv[2:]]
    sys.exit(main())
    """
)


def test_without_a_c_compiler_both_distributions_build_and_run_in_python(tmp_path: Path) -> None:
    """setup.py marks every extension optional: with no compiler the sdists still build
    wheels, without extensions, and the code they install runs on the Python each step
    has, finding what the extensions find (README: Install)."""
    vendor = (
        tmp_path / "vendor"
    )  # both wheels and their dependencies, as `pip install --target` lays them out
    vendor.mkdir()
    for project in (LIBRARY, COLLECTOR):
        (tmp_path / project.name).mkdir()
        with zipfile.ZipFile(wheel_without_a_compiler(project, tmp_path / project.name)) as wheel:
            assert not [name for name in wheel.namelist() if name.endswith(".so")], project
            wheel.extractall(vendor)
    site_packages = next(Path(p) for p in sys.path if p.endswith("site-packages") and Path(p).is_dir())
    for entry in site_packages.iterdir():
        if not entry.name.startswith(("durable_sessions", "__editable__", "_durable_sessions")):
            (vendor / entry.name).symlink_to(entry)
    bare = tmp_path / "bare"  # an interpreter with nothing installed, so nothing comes from the repository
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(bare)], check=True)
    logs = sorted(str(path) for path in (ROOT / "examples" / "logs").glob("*.jsonl"))
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "DURABLE_SESSIONS_NATIVE")}
    done = subprocess.run(
        [str(bare / "bin" / "python"), "-c", NO_COMPILER_SCRIPT, str(vendor), *logs],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    lines = done.stdout.splitlines()
    assert lines[:3] == [
        "extensions [None, None, None, None] False",
        "processor process ['unkeyed-side-effect'] 0",
        "decoded 1",
    ], done.stdout + done.stderr
    native = subprocess.run(
        [sys.executable, "-m", "durable_sessions", "check", *logs], env=env, capture_output=True, text=True
    )
    assert native.stdout and (done.returncode, lines[3:]) == (native.returncode, native.stdout.splitlines())
    for cli in ("durable_sessions.cli", "durable_sessions_collector.cli"):
        shown = subprocess.run(
            [str(bare / "bin" / "python"), "-c", VERSION_SCRIPT, str(vendor), cli],
            env=env,
            capture_output=True,
            text=True,
        )
        assert shown.stdout.splitlines()[1:] == ["C extensions not built; the Python code runs"], shown


VERSION_SCRIPT = textwrap.dedent(
    """\
    import importlib, sys
    sys.path.insert(0, sys.argv[1])
    cli = importlib.import_module(sys.argv[2])
    cli.main(["--version"])
    """
)


def wheel_members(project: Path, tmp_path: Path) -> set[str]:
    """The files of the wheel pip builds from ``project``'s sdist (without a compiler, which
    adds only the extensions)."""
    with zipfile.ZipFile(wheel_without_a_compiler(project, tmp_path)) as wheel:
        return set(wheel.namelist())


PACKAGES = {LIBRARY: "durable_sessions", COLLECTOR: "durable_sessions_collector"}


def test_each_wheel_marks_its_package_typed(tmp_path: Path) -> None:
    """Both packages' public APIs carry type hints; without ``py.typed`` (PEP 561) a type
    checker in the user's project ignores them and reads every name as ``Any``. Built from
    the sdist, so the marker is in both."""
    for project, package in PACKAGES.items():
        (tmp_path / project.name).mkdir()
        assert f"{package}/py.typed" in wheel_members(project, tmp_path / project.name), project


def test_each_distribution_carries_the_license_it_declares(tmp_path: Path) -> None:
    """Both declare Apache-2.0, whose section 4(a) asks that a copy of the license go with
    every redistribution: the sdist and the wheel (``License-File``) each carry its text."""
    for project in PACKAGES:
        (tmp_path / project.name).mkdir()
        assert "LICENSE" in sdist_members(project, tmp_path / project.name), project
        described = metadata(project, tmp_path / project.name)
        assert described["License-Expression"] == "Apache-2.0", project
        assert described.get_all("License-File") == ["LICENSE"], project
        (tmp_path / project.name / "wheel").mkdir()
        wheel = wheel_members(project, tmp_path / project.name / "wheel")
        assert [name for name in wheel if name.endswith(".dist-info/licenses/LICENSE")], project


def test_the_collector_sdist_carries_the_source_of_its_generated_api(tmp_path: Path) -> None:
    """``api/v1/*_pb2*.py`` are generated from ``proto/`` (``make proto``): the sdist is the
    source release, so it carries the ``.proto`` they come from, which a packager needs to
    generate them again and a client in another language to call the API."""
    members = sdist_members(COLLECTOR, tmp_path)
    protos = {str(path.relative_to(ROOT)) for path in (ROOT / "proto").rglob("*.proto")}
    assert protos and protos <= members, sorted(members)


def test_the_collector_sdist_regenerates_its_api_as_committed(tmp_path: Path) -> None:
    """A packager regenerates ``api/v1/*_pb2*.py`` from the sdist alone (no repository
    around it), with the script ``make proto`` runs: the sdist carries it, and it finds
    ``proto/`` and the package beside itself, and writes what is committed."""
    source = unpacked_sdist(COLLECTOR, tmp_path)
    out = tmp_path / "generated"
    result = subprocess.run(
        [sys.executable, str(source / "scripts" / "generate_api.py"), "--out", str(out)],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    packed = source / "src" / "durable_sessions_collector" / "api" / "v1"
    for name in ("sessions_pb2.py", "sessions_pb2_grpc.py"):
        assert (out / name).read_text(encoding="utf-8") == (packed / name).read_text(encoding="utf-8"), name
