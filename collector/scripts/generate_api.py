"""Regenerate the Python code of the sidecar's gRPC API from ``proto/`` with grpcio-tools.

From the repository root, or as ``scripts/generate_api.py`` from the collector's sdist:

    .venv/bin/python collector/scripts/generate_api.py            # into the package (make proto)
    .venv/bin/python collector/scripts/generate_api.py --out DIR  # elsewhere (the up-to-date test)

protoc names the generated import after the proto's path (``durable_sessions.v1``),
which is the engine's package; the import in ``*_pb2_grpc.py`` is rewritten to the
collector's package, where the code lives. The descriptor keeps the proto's own path.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from importlib import metadata, resources
from pathlib import Path

# Paths from the collector's project directory, the same in the repository (where proto
# is a link to the repository's proto/) and in the collector's sdist (which packs both).
PROJECT = Path(__file__).resolve().parents[1]
PROTO_ROOT = PROJECT / "proto"
PROTOS = ("durable_sessions/v1/sessions.proto",)
PACKAGE_DIR = PROJECT / "src" / "durable_sessions_collector" / "api" / "v1"
GENERATED_IMPORT = "from durable_sessions.v1 import"
PACKAGE_IMPORT = "from durable_sessions_collector.api.v1 import"
GRPCIO_TOOLS = "1.85.1"  # the version the committed code was generated with (collector[test] pins it)


def generate(out: Path) -> list[Path]:
    """Write the generated modules into ``out``; return their paths."""
    from grpc_tools import protoc

    installed = metadata.version("grpcio-tools")
    if installed != GRPCIO_TOOLS:
        raise SystemExit(
            f"grpcio-tools {installed} is installed; the committed code is generated with "
            f"{GRPCIO_TOOLS}: pip install grpcio-tools=={GRPCIO_TOOLS} (or update GRPCIO_TOOLS and regenerate)"
        )
    well_known = str(resources.files("grpc_tools") / "_proto")
    written: list[Path] = []
    with tempfile.TemporaryDirectory() as scratch:
        for proto in PROTOS:
            code = protoc.main(
                [
                    "grpc_tools.protoc",
                    f"-I{PROTO_ROOT}",
                    f"-I{well_known}",
                    f"--python_out={scratch}",
                    f"--grpc_python_out={scratch}",
                    str(PROTO_ROOT / proto),
                ]
            )
            if code != 0:
                raise SystemExit(f"protoc failed on {proto} (exit {code})")
            stem = Path(proto).with_suffix("")
            for suffix in ("_pb2.py", "_pb2_grpc.py"):
                source = Path(scratch) / f"{stem}{suffix}"
                text = source.read_text(encoding="utf-8").replace(GENERATED_IMPORT, PACKAGE_IMPORT)
                target = out / source.name
                target.write_text(text, encoding="utf-8")
                written.append(target)
    return written


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=PACKAGE_DIR, help="directory to write into")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    for path in generate(args.out):
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
