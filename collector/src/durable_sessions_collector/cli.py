"""``durable-sessions-collector``: run the sidecar.

    durable-sessions-collector serve [--config FILE] [--grpc-endpoint HOST:PORT] ...
    durable-sessions-collector config [--config FILE] [...]   # print the resolved configuration
    durable-sessions-collector config-reference                # every key, variable and flag
    durable-sessions-collector sessions list [--verdict V] [--all]   # over the HTTP API
    durable-sessions-collector sessions show SESSION_ID
    durable-sessions-collector alerts dead [--channel C]        # dead-lettered alerts, from the store
    durable-sessions-collector alerts redeliver [--channel C]   # queue them for delivery again

Exit codes: 0 after a clean stop, 2 for invalid configuration or a port that cannot be
bound (the message names the key, and why: "Address already in use") or a store that
cannot be opened, 1 for any other
failure to start. ``sessions``: 0,
1 when the sidecar cannot answer (unreachable, 401, no such session, a redirect), 2 for bad usage
(an endpoint that is not an http(s) URL with a host (and a port, when given, from 0 to 65535; none
means 80 or 443), or has a query, fragment, user
or password, an unreadable token, CA
file or client certificate, a CA file or client certificate with an http:// endpoint, a bad
--verdict or --limit, an empty SESSION_ID). ``alerts``: 0, 2 for bad usage
or a store that cannot be opened (missing, not a store, another schema version), 1 when
the store fails during the command. The commands that print (``config``,
``config-reference``, ``sessions``) end as ``durable-sessions`` does: 141 quietly when
the reader of their output goes away (``| head``), 130 on Ctrl-C, 143 on SIGTERM, 2 when
standard output cannot be written.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import warnings
from collections.abc import Callable, Sequence
from datetime import UTC, datetime
from typing import Any, NamedTuple

from durable_sessions.cli import Output, Parser, add_version, run_command
from durable_sessions.native import LIBRARY_EXTENSIONS, SWITCH
from durable_sessions.report import printable, table_lines
from durable_sessions_collector import __version__
from durable_sessions_collector.alerts import OTLP, WEBHOOK
from durable_sessions_collector.client import (
    DEFAULT_ENDPOINT,
    ENDPOINT_ENV,
    TLS_VARIABLES,
    TOKEN_ENV,
    TOKEN_FILE_ENV,
    ApiClient,
    ApiError,
    ApiUsageError,
)
from durable_sessions_collector.config import (
    OPTIONS,
    Config,
    ConfigError,
    check_token,
    load,
    reference,
    store_secrets,
)
from durable_sessions_collector.environment import NOT_READ, unknown_variables
from durable_sessions_collector.redaction import RedactingStream
from durable_sessions_collector.store import DeadAlert, Store, StoreError, open_store

COLLECTOR_EXTENSIONS = (
    ("durable_sessions_collector.otlp", "_wire"),
    ("durable_sessions_collector.store", "_rows"),
)
"""This distribution's C extensions (package, module name), which ``--version`` names."""


def _parser() -> argparse.ArgumentParser:
    parser = Parser(
        prog="durable-sessions-collector",
        description="The durable-sessions sidecar: OTLP in, whole-session verdicts and alerts out.",
    )
    add_version(parser, __version__, (*LIBRARY_EXTENSIONS, *COLLECTOR_EXTENSIONS))
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
            # A true/false flag alone means true, as durable-sessions check --strict does.
            alone = {"nargs": "?", "const": "true"} if option.boolean else {}
            command.add_argument(
                option.flag, dest=option.attr, metavar="VALUE", help=f"{option.key}: {option.doc}", **alone
            )
    commands.add_parser("config-reference", help="print every setting with its variable and flag (Markdown)")
    _sessions_parser(commands)
    _alerts_parser(commands)
    return parser


def _alerts_parser(commands: Any) -> None:
    text = "list dead-lettered alerts, or queue them for delivery again, in the configured store"
    alerts = commands.add_parser("alerts", help=text, description=text)
    which = alerts.add_subparsers(dest="alerts_command", required=True)
    dead = which.add_parser("dead", help="list dead-lettered alerts, oldest first")
    redeliver = which.add_parser(
        "redeliver",
        help="queue dead-lettered alerts for delivery again, with their attempts from zero; "
        "a running sidecar delivers them within a second",
    )
    for command in (dead, redeliver):
        command.add_argument(
            "--config", metavar="FILE", help="YAML configuration file (or $DURABLE_SESSIONS_CONFIG)"
        )
        command.add_argument("--store", dest=_STORE.attr, metavar="URL", help=f"store: {_STORE.doc}")
        command.add_argument("--channel", choices=(WEBHOOK, OTLP), help="only this channel")
    dead.add_argument("--limit", type=int, default=100, help="at most this many (1-1000, default 100)")
    dead.add_argument("--json", action="store_true", help="print JSON instead of a table")


_STORE = next(option for option in OPTIONS if option.key == "store")


def _sessions_parser(commands: Any) -> None:
    text = "list or show sessions through a running sidecar's HTTP API"
    sessions = commands.add_parser("sessions", help=text, description=text)
    _client_options(sessions)
    which = sessions.add_subparsers(dest="sessions_command", required=True)
    listing = which.add_parser("list", help="sessions, most recently active first")
    _client_options(listing, again=True)
    listing.add_argument("--verdict", choices=("ok", "at_risk", "unrecoverable"), help="only this verdict")
    listing.add_argument(
        "--limit",
        type=int,
        default=100,
        help="at most this many (1-1000, default 100); with --all, a page's size",
    )
    listing.add_argument(
        "--all",
        action="store_true",
        help="every session, asked page by page in the order of their ids (each once, even one active "
        "meanwhile), shown most recently active first",
    )
    show = which.add_parser("show", help="one session: its actions, violations and verdict")
    _client_options(show, again=True)
    show.add_argument("session_id", metavar="SESSION_ID")


def _client_options(parser: argparse.ArgumentParser, *, again: bool = False) -> None:
    """How ``sessions`` reaches the API. ``again``: the same options on ``list`` and
    ``show``, so that ``sessions list --json`` works as ``alerts dead --json`` does; given
    there, they override the ones before the subcommand, and are left unset otherwise."""

    def default(value: Any) -> Any:
        return argparse.SUPPRESS if again else value

    parser.add_argument(
        "--endpoint",
        default=default(_variable(ENDPOINT_ENV) or DEFAULT_ENDPOINT),
        help=f"the sidecar's HTTP endpoint (or $DURABLE_SESSIONS_API_ENDPOINT; default {DEFAULT_ENDPOINT}); "
        "https://… when it serves TLS",
    )
    # A flag beats the environment: --token or --token-file, then $DURABLE_SESSIONS_AUTH_TOKEN,
    # then $DURABLE_SESSIONS_AUTH_TOKEN_FILE. The two flags are one setting (one dest, the
    # value tagged with its flag), so the one after the subcommand wins over either before it.
    token = parser.add_mutually_exclusive_group()
    token.add_argument(
        "--token",
        dest="token",
        metavar="TOKEN",
        type=lambda value: _TokenFlag("--token", value),
        default=default(None),
        help="bearer token (or $DURABLE_SESSIONS_AUTH_TOKEN; prefer the variable or --token-file, "
        "a flag is visible to other users in the process list)",
    )
    token.add_argument(
        "--token-file",
        dest="token",
        metavar="FILE",
        type=lambda path: _TokenFlag("--token-file", path),
        default=default(None),
        help="file holding the bearer token (or $DURABLE_SESSIONS_AUTH_TOKEN_FILE)",
    )
    parser.add_argument(
        "--ca-file",
        default=default(_variable(TLS_VARIABLES["ca_file"])),
        help="PEM CA certificate(s) to verify the sidecar's TLS certificate (or $DURABLE_SESSIONS_CA_FILE)",
    )
    parser.add_argument(
        "--cert-file",
        default=default(_variable(TLS_VARIABLES["cert_file"])),
        help="PEM client certificate for a sidecar that requires one (tls.client_ca_file, mutual TLS); "
        "its key in --key-file or in the same file (or $DURABLE_SESSIONS_CLIENT_CERT_FILE)",
    )
    parser.add_argument(
        "--key-file",
        default=default(_variable(TLS_VARIABLES["key_file"])),
        help="PEM private key of --cert-file, unencrypted (or $DURABLE_SESSIONS_CLIENT_KEY_FILE)",
    )
    parser.add_argument(
        "--json", action="store_true", default=default(False), help="print the API's JSON instead of a table"
    )


def _variable(name: str) -> str | None:
    """A ``sessions`` variable, read without surrounding whitespace as the sidecar reads its
    own (a value from a ConfigMap or a ``$(cat …)`` ends in a line break); None if blank."""
    return os.environ.get(name, "").strip() or None


class _TokenFlag(NamedTuple):
    """``--token`` or ``--token-file`` as given: which of the two, and its value."""

    flag: str
    value: str


def _token(args: argparse.Namespace) -> str | None:
    """The bearer token to send, stripped as the sidecar strips its own (a Kubernetes Secret
    read from a file ends in a newline) and checked, since http.client refuses a bad header
    value in a message that repeats it. :class:`ApiUsageError` never repeats the token."""
    given: _TokenFlag | None = args.token if args.token and args.token.value else None
    token = given.value if given and given.flag == "--token" else None
    token_file = given.value if given and given.flag == "--token-file" else None
    source = "--token"
    if given is None:
        token = _variable(TOKEN_ENV)
        token_file = _variable(TOKEN_FILE_ENV)
        source = f"${TOKEN_ENV}"
    if token is None and token_file:
        source = f"the token file {token_file!r}"
        token = _read_token_file(source, token_file)
    if token is None:
        return None
    try:
        return check_token(token.strip())
    except ValueError as error:
        raise ApiUsageError(f"{source}: {error}") from None


def _read_token_file(source: str, path: str) -> str:
    try:
        with open(path, encoding="utf-8") as handle:
            return handle.read()
    except OSError as error:
        raise ApiUsageError(f"cannot read {source}: {error.strerror or error}") from None
    except UnicodeDecodeError:  # its message shows a byte of the file
        raise ApiUsageError(f"{source} is not UTF-8 text (value not shown)") from None


def _sessions(args: argparse.Namespace, out: Output) -> int:
    try:
        client = ApiClient(
            args.endpoint,
            token=_token(args),
            ca_file=args.ca_file,
            cert_file=args.cert_file,
            key_file=args.key_file,
        )
    except ApiUsageError as error:
        _complain(str(error))
        return 2
    try:
        if args.sessions_command == "list":
            if not 1 <= args.limit <= 1000:
                _complain("--limit must be from 1 to 1000")
                return 2
            sessions, token = client.list_sessions(
                args.verdict, args.limit, every_page=args.all, warn=_complain
            )
            if args.json:
                print(json.dumps({"sessions": sessions, "next_page_token": token}, indent=2), file=out)
            else:
                _print_sessions(sessions, out)
                if token:  # the table alone reads as every session there is (a page may end early, by size)
                    _complain(f"more sessions than the {len(sessions)} shown; --all lists every one")
            return 0
        if not args.session_id:  # no session has one: it would be asked as the path /api/sessions/
            _complain("SESSION_ID must not be empty")
            return 2
        detail = client.session(args.session_id)
    except ApiError as error:
        _complain(str(error))
        return 2 if isinstance(error, ApiUsageError) else 1
    if args.json:
        print(json.dumps(detail, indent=2), file=out)
    else:
        _print_session(detail, out)
    return 0


def _alerts(args: argparse.Namespace, config: Config, out: Output) -> int:
    if args.alerts_command == "dead" and not 1 <= args.limit <= 1000:
        _complain("--limit must be from 1 to 1000")
        return 2
    try:
        redact = _redactor(config)  # a token file that cannot be read: said before the store is opened
    except ConfigError as error:
        _complain(f"invalid configuration: {error}")
        return 2
    try:
        store = open_store(config.store, exclusive=False)
    except StoreError as error:
        _complain(f"store: {error}", config)
        return 2
    try:
        if args.alerts_command == "redeliver":
            _redeliver(store, args.channel, config, out)
            return 0
        alerts = store.dead_alerts(args.channel, args.limit + 1)  # one more: are there others?
        _print_dead(alerts[: args.limit], args.json, out, redact)
        if len(alerts) > args.limit:  # the list alone reads as every dead letter there is
            _complain(f"more dead-lettered alerts than the {args.limit} shown; --limit lists up to 1000")
        return 0
    except StoreError as error:
        _complain(f"store: {error}", config)
        return 1
    finally:
        store.close()


def _redeliver(store: Store, channel: str | None, config: Config, out: Output) -> None:
    """Queue the dead letters again, channel by channel, and say which channel the
    configuration does not deliver (its alerts wait for a sidecar that does)."""
    configured = {WEBHOOK: bool(config.alerts_webhook_url), OTLP: bool(config.alerts_otlp_endpoint)}
    total = 0
    for name in (channel,) if channel else (WEBHOOK, OTLP):
        with store.writer() as writer:
            count = writer.redeliver_dead(name, store.now())
        total += count
        if count and not configured[name]:
            _complain(
                f"{count} {name} alert(s) queued, but the configuration read here (--config, environment) has no "
                f"{name} channel: a sidecar that has one delivers them"
            )
    print(f"{total} dead-lettered alert(s) queued for delivery again", file=out)


def _redactor(config: Config) -> Callable[[str | None], str | None]:
    """The log's redactor for the configured secrets: a last error stored by an earlier
    version, which stored it as the receiver or http.client wrote it, shows no more than
    the log did."""
    scrub = RedactingStream(None, config.secrets()).scrub
    return lambda text: None if text is None else scrub(text)


def _print_dead(
    alerts: list[DeadAlert], as_json: bool, out: Output, redact: Callable[[str | None], str | None]
) -> None:
    if as_json:
        document = [
            {
                "id": alert.id,
                "channel": alert.channel,
                "violation_key": alert.violation_key,
                "attempts": alert.attempts,
                "last_error": redact(alert.last_error),
                "created_at": alert.created_at,
                "alert": alert.payload,
            }
            for alert in alerts
        ]
        print(json.dumps({"dead": document}, indent=2), file=out)
        return
    if not alerts:
        print("no dead-lettered alerts", file=out)
        return
    rows = [("ID", "CHANNEL", "RULE", "SESSION", "ACTION", "ATTEMPTS", "CREATED", "LAST ERROR")]
    for alert in alerts:
        rows.append(
            (
                str(alert.id),
                printable(alert.channel),
                _cell(alert.payload.get("rule")),
                _cell(alert.payload.get("session_id")),
                _cell(alert.payload.get("action_id")),
                str(alert.attempts),
                _when(alert.created_at),
                printable(redact(alert.last_error) or "-"),
            )
        )
    for line in table_lines(rows):
        print(line, file=out)


def _complain(message: str, config: Config | None = None) -> None:
    """Write ``durable-sessions-collector: message`` on standard error: every message of
    the commands goes through here. With ``config``, the store URL's secrets
    (:func:`store_secrets`, whatever their length) are replaced by ``***``, by the log's
    own redactor: a :class:`StoreError` repeats libpq's message, which quotes the part of
    the URL libpq could not read, the password or the whole URL."""
    secrets = store_secrets(config.store) if config is not None else []
    RedactingStream(sys.stderr, secrets).write(f"durable-sessions-collector: {message}\n")


def _printing(text: str) -> Callable[[Output], int]:
    """The command that prints ``text``."""

    def command(out: Output) -> int:
        out.write(text)
        return 0

    return command


def _when(ts: Any) -> str:
    if not isinstance(ts, int | float):
        return "-"
    try:
        return datetime.fromtimestamp(ts, UTC).strftime("%Y-%m-%d %H:%M:%SZ")
    except (OverflowError, OSError, ValueError):  # out of datetime's range, or NaN
        return "-"


def _cell(value: Any) -> str:
    """A value of the API's JSON as text (the client checked only the keys it needs),
    escaped by :func:`printable`: ids, kinds and messages are the text of spans, which
    anyone who can export to the sidecar writes."""
    return "-" if value is None else printable(str(value))


def _print_sessions(sessions: list[dict[str, Any]], out: Output) -> None:
    if not sessions:
        print("no sessions", file=out)
        return
    rows = [("SESSION", "VERDICT", "STATE", "ACTIONS", "ERRORS", "WARNINGS", "LAST SEEN")]
    for s in sessions:
        cells = (
            _cell(s.get(key)) for key in ("session_id", "verdict", "state", "actions", "errors", "warnings")
        )
        rows.append((*cells, _when(s.get("last_seen"))))
    for line in table_lines(rows):
        print(line, file=out)


def _print_session(detail: dict[str, Any], out: Output) -> None:
    d = {
        key: _cell(detail.get(key))
        for key in ("session_id", "verdict", "state", "action_count", "errors", "warnings")
    }
    print(f"session {d['session_id']}: {d['verdict']} ({d['state']})", file=out)
    print(f"  {d['action_count']} action(s), {d['errors']} error(s), {d['warnings']} warning(s); "
          f"first seen {_when(detail.get('first_seen'))}, last seen {_when(detail.get('last_seen'))}", file=out)  # fmt: skip
    print("actions:", file=out)
    for action in detail["actions"]:
        extras = [f"incarnation {_cell(action['incarnation'])}"] if action.get("incarnation") else []
        for flag in ("replayed", "retryable"):
            if action.get(flag) is True:
                extras.append(flag)
        if action.get("idempotency_key"):
            extras.append("keyed")
        suffix = f" ({', '.join(extras)})" if extras else ""
        what = "  ".join(_cell(action.get(key)) for key in ("action_id", "kind", "status"))
        print(f"  {what}{suffix}", file=out)
    live = [v for v in detail["violations"] if not v.get("resolved")]
    print("violations:" if live else "violations: none", file=out)
    for v in live:
        # A finding of a rule the sidecar no longer runs stays listed, but not in the verdict.
        uncounted = "  (not counted: rule not run)" if v.get("not_counted") else ""
        severity, rule, action_id, message = (
            _cell(v.get(key)) for key in ("severity", "rule", "action_id", "message")
        )
        print(f"  {severity}  {rule}  action {action_id}: {message}{uncounted}", file=out)


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    prog = f"durable-sessions-collector {args.command}"
    if args.command == "config-reference":
        return run_command(prog, _printing(reference()))
    if args.command == "sessions":
        return run_command(prog, lambda out: _sessions(args, out))
    overrides = {option.attr: getattr(args, option.attr, None) for option in OPTIONS}
    try:
        config = load(args.config, overrides=overrides)
    except ConfigError as error:
        _complain(f"invalid configuration: {error}")
        return 2
    if args.command == "alerts":
        return run_command(prog, lambda out: _alerts(args, config, out))
    if args.command == "config":
        # What one runs to see why a setting is not what was meant: a misspelt variable is why.
        for name, close in unknown_variables(os.environ):
            _complain(
                f"warning: {name} is set, but {NOT_READ}" + (f"; did you mean {close}?" if close else "")
            )
        # Secrets (the token, the webhook URL's credentials and query) are shown as ***.
        document = json.dumps({"settings": config.display(), "sources": dict(config.sources)}, indent=2)
        return run_command(prog, _printing(document + "\n"))
    # Standard error carries JSON lines only, which log shippers parse; grpcio's core
    # writes its own format there (a failed TLS handshake, an unknown grpc-encoding).
    # It reads this before grpc is first imported; a user's setting wins.
    os.environ.setdefault("GRPC_VERBOSITY", "NONE")
    # So does Python's warning of a DURABLE_SESSIONS_NATIVE neither on nor off, written as
    # the extensions load: Service logs it as a JSON line instead.
    warnings.filterwarnings("ignore", message=re.escape(SWITCH) + "=", category=RuntimeWarning)
    from durable_sessions_collector.service import Service

    try:
        service = Service(config)
        service.serve_forever()
    except ConfigError as error:
        _complain(f"invalid configuration: {error}", config)
        return 2
    except StoreError as error:
        _complain(f"store: {error}", config)
        return 2
    except OSError as error:
        _complain(f"cannot start: {error}", config)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
