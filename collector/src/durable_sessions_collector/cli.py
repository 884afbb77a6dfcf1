"""``durable-sessions-collector``: run the sidecar.

    durable-sessions-collector serve [--config FILE] [--grpc-endpoint HOST:PORT] ...
    durable-sessions-collector config [--config FILE] [...]   # print the resolved configuration
    durable-sessions-collector config-reference                # every key, variable and flag

Exit codes: 0 after a clean stop, 2 for invalid configuration or a port that cannot be
bound (the message names the key), 1 for any other failure to start.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

from durable_sessions_collector import __version__
from durable_sessions_collector.config import OPTIONS, ConfigError, load, reference
from durable_sessions_collector.store import StoreError


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="durable-sessions-collector",
        description="The durable-sessions sidecar: OTLP in, whole-session verdicts and alerts out.",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    commands = parser.add_subparsers(dest="command", required=True)
    for name, text in (
        ("serve", "run the sidecar until SIGTERM or SIGINT"),
        ("config", "print the resolved configuration as JSON and exit"),
    ):
        command = commands.add_parser(name, help=text, description=text)
        command.add_argument(
            "--config", metavar="FILE", help="YAML configuration file (or $DURABLE_SESSIONS_CONFIG)"
        )
        for option in OPTIONS:
            command.add_argument(
                option.flag, dest=option.attr, metavar="VALUE", help=f"{option.key}: {option.doc}"
            )
    commands.add_parser("config-reference", help="print every setting with its variable and flag (Markdown)")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.command == "config-reference":
        sys.stdout.write(reference())
        return 0
    overrides = {option.attr: getattr(args, option.attr) for option in OPTIONS}
    try:
        config = load(args.config, overrides=overrides)
    except ConfigError as error:
        print(f"durable-sessions-collector: invalid configuration: {error}", file=sys.stderr)
        return 2
    if args.command == "config":
        document = {option.key: getattr(config, option.attr) for option in OPTIONS}
        print(json.dumps({"settings": document, "sources": dict(config.sources)}, indent=2))
        return 0
    from durable_sessions_collector.service import Service

    service = Service(config)
    try:
        service.serve_forever()
    except StoreError as error:
        print(f"durable-sessions-collector: store: {error}", file=sys.stderr)
        return 2
    except OSError as error:
        print(f"durable-sessions-collector: cannot start: {error}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
