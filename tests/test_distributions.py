"""The two distributions as pip sees them: the metadata and sdists that setuptools' own
PEP 517 hooks make from ``pyproject.toml`` and ``setup.py``, built here from the
repository (into a temporary directory, leaving the tree as it was)."""

from __future__ import annotations

import email.parser
import subprocess
import sys
import tarfile
import textwrap
from email.message import Message
from pathlib import Path

from packaging.requirements import Requirement
from packaging.version import Version

import durable_sessions

ROOT = Path(__file__).resolve().parents[1]
LIBRARY = ROOT
COLLECTOR = ROOT / "collector"


def build_hook(project: Path, hook: str, out: Path) -> Path:
    """Run setuptools' ``hook`` (``prepare_metadata_for_build_wheel``, ``build_sdist``)
    in ``project`` as a build frontend does, in a process of its own, and return what it
    made in ``out``."""
    out.mkdir()
    code = textwrap.dedent(
        f"""\
        import sys
        from setuptools import build_meta
        print(build_meta.{hook}(sys.argv[1]))
        """
    )
    result = subprocess.run(
        [sys.executable, "-c", code, str(out)], cwd=project, capture_output=True, text=True, timeout=120
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
