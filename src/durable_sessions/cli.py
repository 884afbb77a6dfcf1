"""Command lines: ``durable-sessions`` and the seed-compatible ``replay-check``.

Exit codes, for both: 0 every action is replay-safe, 1 at least one violation (at or
above ``--fail-on``), 2 usage error, unreadable input or unwritable output. A run cut
short exits as a shell reports a command killed by the signal, 128 + its number: 130
on Ctrl-C (SIGINT), 143 on SIGTERM, 141 when the reader of the output went away
(``| head``: SIGPIPE). These never print a traceback, and stop the worker processes.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import shlex
import signal
import sqlite3
import stat
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any, TextIO

from durable_sessions import __version__, crash
from durable_sessions.check import (
    OfflineCheck,
    check_paths,
    cli_start_method,
    cyclic_gc_paused,
    default_jobs,
    offline_checker,
    sdk_attribute_value_limit,
    usable_cores,
)
from durable_sessions.harness import (
    DEFAULT_MAX_BOUNDARIES,
    DEFAULT_TIMEOUT_S,
    describe,
    proof_document,
    prove,
)
from durable_sessions.journal import AlreadyCompleted, Entry, SessionLive, SqliteJournal
from durable_sessions.native import LIBRARY_EXTENSIONS, extensions_note
from durable_sessions.readers import DEFAULT_MAX_LINE_BYTES, FORMATS, InputError, sniff_format
from durable_sessions.report import (
    OUTPUT_FORMATS,
    Summary,
    dump_json,
    explain_markdown,
    json_document,
    printable,
    rules_markdown,
    sarif_document,
    table_lines,
    text_line,
    write_text_summary,
)
from durable_sessions.rules import CATALOGUE, PRESETS, select_rules
from durable_sessions.rules.state import DEFAULT_KEY_WINDOW_S
from durable_sessions.seconds import positive_seconds_from_text
from durable_sessions.violation import Violation

EXIT_OK, EXIT_VIOLATIONS, EXIT_USAGE = 0, 1, 2
EXIT_BROKEN_PIPE, EXIT_INTERRUPTED, EXIT_TERMINATED = 128 + 13, 128 + 2, 128 + 15
CHECK_EXITS_BEYOND_1 = (
    f"{EXIT_USAGE}: usage, unreadable input or unwritable output; {EXIT_INTERRUPTED} (Ctrl-C), "
    f"{EXIT_TERMINATED} (SIGTERM), {EXIT_BROKEN_PIPE} (SIGPIPE): the run was cut short."
)
"""How the checking commands end besides 0 and 1 (:func:`run_command`), for their --help."""


class OutputError(Exception):
    """Standard output cannot be written (closed, a full disk, an I/O error)."""


class _Terminated(BaseException):
    """SIGTERM, raised in the main thread so that the check unwinds and stops its workers."""


class Output:
    """Standard output, where a failed write is an :class:`OutputError` to report in one
    line, not a traceback; a reader gone away stays ``BrokenPipeError`` (exit 141)."""

    def __init__(self, stream: TextIO) -> None:
        self.stream = stream

    def write(self, text: str) -> int:
        with _as_output_error():
            return self.stream.write(text)

    def flush(self) -> None:
        with _as_output_error():
            self.stream.flush()


@contextlib.contextmanager
def _as_output_error() -> Iterator[None]:
    """An OSError of standard output as :class:`OutputError`, BrokenPipeError as it is."""
    try:
        yield
    except BrokenPipeError:
        raise
    except OSError as error:
        raise OutputError(error.strerror or str(error)) from None


def run_command(prog: str, command: Callable[[Output], int]) -> int:
    """Run ``command``, which writes to the standard output it is given, and end as a tool
    in a pipe, a CI job or cron must: the exit codes of the module's docstring, a one-line
    message on standard error, never a traceback. ``durable-sessions-collector``'s commands
    that print run through it too."""
    if sys.stdout is None:  # started with standard output closed (``>&-``)
        print(f"{prog}: cannot write to standard output: it is closed", file=sys.stderr)
        return EXIT_USAGE
    if sys.stdout.errors == "strict" and hasattr(sys.stdout, "reconfigure"):
        # Session ids, file names and the messages' dashes are not ASCII: in a locale
        # that cannot encode them (LANG=C without UTF-8 mode, PYTHONIOENCODING=ascii)
        # write them as escapes rather than stop with UnicodeEncodeError.
        sys.stdout.reconfigure(errors="backslashreplace")
    terminate = _on_sigterm()
    out = Output(sys.stdout)
    try:
        code = command(out)
        out.flush()  # a write error shows here, not as a traceback at exit
        return code
    except BrokenPipeError:
        # The reader went away (``| head``): stop quietly, as a tool killed by SIGPIPE.
        # Standard output now goes nowhere, so that the flush at exit cannot fail again.
        with contextlib.suppress(OSError, ValueError):
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_BROKEN_PIPE
    except OutputError as error:
        print(f"{prog}: cannot write to standard output: {error}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED
    except _Terminated:
        return EXIT_TERMINATED
    finally:
        terminate()


def _on_sigterm() -> Callable[[], None]:
    """Make SIGTERM raise :class:`_Terminated` until the returned function restores it."""
    if threading.current_thread() is not threading.main_thread():
        return lambda: None  # only the main thread may set handlers (a test calling main)

    def raise_terminated(signum: int, frame: Any) -> None:
        raise _Terminated

    previous = signal.signal(signal.SIGTERM, raise_terminated)
    return lambda: signal.signal(signal.SIGTERM, previous)


# -- replay-check ---------------------------------------------------------------------


def replay_check_main(argv: Sequence[str] | None = None) -> int:
    """``replay-check --actions FILE [--strict] [--quiet]``: the seed checker's contract."""
    parser = Parser(
        prog="replay-check",
        description="Check that every action in a JSONL session log is replay-safe.",
        epilog=f"Exit 0: every action is replay-safe; 1: violations; {CHECK_EXITS_BEYOND_1}",
    )
    parser.add_argument("--actions", required=True, metavar="FILE", help="JSONL action log ('-' for stdin)")
    parser.add_argument("--strict", action="store_true", help="also demand on_failure on dead ends")
    parser.add_argument("--quiet", action="store_true", help="print the summary line only")
    args = parser.parse_args(argv)
    return run_command("replay-check", lambda out: _replay_check(args, out))


def _replay_check(args: argparse.Namespace, out: Output) -> int:
    checker = offline_checker(select_rules("seed", strict=args.strict))
    count = 0
    _hint_at_trace_files(args.actions)
    try:
        with cyclic_gc_paused():
            for violation in check_paths([args.actions], checker, fmt="actions"):
                count += 1
                if not args.quiet:
                    line = f"line {violation.line} [{violation.action_id or '?'}]: {violation.message}"
                    out.write(printable(line) + "\n")
    except InputError as error:
        print(f"replay-check: {error}", file=sys.stderr)
        return EXIT_USAGE
    if count:
        if not args.quiet:
            out.write("\n")
        out.write(f"replay-check FAIL: {count} violation(s) in {checker.actions} action(s)\n")
        return EXIT_VIOLATIONS
    out.write(f"replay-check OK: {checker.actions} action(s) replay-safe\n")
    return EXIT_OK


def _hint_at_trace_files(path: str) -> None:
    """replay-check reads action logs only, as the seed's did: each line of a trace file
    is an action with every required field missing. Say so once, on standard error (the
    seed's output stays as it was), and what reads such a file.

    Only a regular file is looked at: a pipe or FIFO (``--actions <(zcat log.gz)``) can be
    read once, and what this look read would be gone for the check, which then passed
    an unread log as ``OK: 0 action(s)``."""
    try:
        if path == "-" or not stat.S_ISREG(os.stat(path).st_mode):
            return
    except (OSError, ValueError):
        return  # the check itself reports a path that cannot be read
    try:
        with open(path, "rb") as source:
            found = sniff_format(source, path, DEFAULT_MAX_LINE_BYTES)
    except (OSError, InputError):
        return  # the check itself reports an unreadable file
    if found != "actions":
        what = "an OTLP/JSON trace file" if found == "otlp-json" else "a tracing log"
        print(
            f"replay-check: {path!r} looks like {what}, and replay-check reads action logs only; "
            f"`durable-sessions check {shlex.quote(path)}` reads it",
            file=sys.stderr,
        )


# -- durable-sessions -----------------------------------------------------------------


class _Version(argparse.Action):
    """``--version``: the version, then on a line of its own which C extensions run
    (argparse's own version action would fold the two into one paragraph)."""

    def __init__(self, option_strings: list[str], dest: str, **kwargs: Any) -> None:
        self.version = kwargs.pop("version")
        self.extensions = kwargs.pop("extensions")
        super().__init__(option_strings, argparse.SUPPRESS, nargs=0, default=argparse.SUPPRESS, **kwargs)

    def __call__(self, parser: argparse.ArgumentParser, *args: Any) -> None:
        print_to_stdout(parser, f"{parser.prog} {self.version}\n{extensions_note(self.extensions)}\n")
        parser.exit()


class Parser(argparse.ArgumentParser):
    """argparse's parser whose ``--help`` ends as every command that prints does when
    standard output cannot take it (exit 2, or 141 for a reader gone away): argparse
    drops the write error and exits 0, so ``--help > /dev/full`` passed for success.
    Its subparsers are of this class too (``add_subparsers`` makes them of its own)."""

    def print_help(self, file: TextIO | None = None) -> None:
        if file is not None:
            super().print_help(file)
        else:
            print_to_stdout(self, self.format_help())


def print_to_stdout(parser: argparse.ArgumentParser, text: str) -> None:
    """Write ``text`` to standard output for ``parser``'s ``--help`` or ``--version``, and
    exit as :func:`run_command` ends a command whose output cannot be written."""

    def write(out: Output) -> int:
        out.write(text)
        return 0

    code = run_command(parser.prog, write)
    if code:
        parser.exit(code)


def add_version(
    parser: argparse.ArgumentParser,
    version: str,
    extensions: tuple[tuple[str, str], ...] = LIBRARY_EXTENSIONS,
) -> None:
    """Give ``parser`` a ``--version`` that also says which of ``extensions`` run."""
    parser.add_argument(
        "--version",
        action=_Version,
        version=version,
        extensions=extensions,
        help="show the version and which C extensions run, and exit",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(
        prog="durable-sessions",
        description="Check that long-running agent sessions can be recovered by replay.",
    )
    add_version(parser, __version__)
    commands = parser.add_subparsers(dest="subcommand", required=True, metavar="COMMAND")

    check = commands.add_parser(
        "check",
        help="check action logs against every rule",
        description="Check JSONL action logs, observability-tracing event logs and OTLP/JSON trace files.",
        epilog=f"Exit 0: no violation at or above --fail-on; 1: violations; {CHECK_EXITS_BEYOND_1}",
    )
    check.add_argument(
        "files", nargs="+", metavar="FILE", help="log files ('-' for stdin); sessions may span files"
    )
    check.add_argument("--strict", action="store_true", help="also run strict-only rules (dead-end)")
    check.add_argument(
        "--format", choices=OUTPUT_FORMATS, default="text", help="output format (default: text)"
    )
    check.add_argument(
        "--fail-on",
        choices=("error", "warning"),
        default="error",
        help="lowest severity that fails (default: error)",
    )
    check.add_argument(
        "--key-window-s",
        type=_positive_seconds,
        default=DEFAULT_KEY_WINDOW_S,
        metavar="N",
        help="idempotency key lifetime at the far side, seconds (default: 86400)",
    )
    check.add_argument(
        "--rules", choices=PRESETS, default="all", help="rule set: the seed checker's, or all (default)"
    )
    check.add_argument(
        "--disable", action="append", default=[], metavar="RULE", help="do not run RULE (repeatable)"
    )
    check.add_argument(
        "--input-format", choices=FORMATS, default="auto", help="input format (default: auto-detect)"
    )
    check.add_argument(
        "--jobs",
        type=_positive_int,
        default=None,
        metavar="N",
        help="worker processes, at most one per core (default: one per core, at most 8, "
        "for JSONL input over 64 MiB, else 1)",
    )
    check.add_argument(
        "--intents",
        action="append",
        default=[],
        metavar="FILE",
        help="an intent log of the span processor (repeatable): side effects started in FILE whose span "
        "never ended are checked too",
    )
    check.add_argument(
        "--max-line-bytes",
        type=_positive_int,
        default=DEFAULT_MAX_LINE_BYTES,
        metavar="N",
        help="longest line read; longer ones are reported (default: 64 MiB)",
    )
    check.add_argument(
        "--attribute-value-limit",
        type=_positive_int,
        default=None,
        metavar="N",
        help="the attribute value length limit OTLP/JSON spans were recorded under, so that a result "
        "that long is a truncated-result, as the span processor and the sidecar judge it (default: "
        "OTEL_SPAN_ATTRIBUTE_VALUE_LENGTH_LIMIT or OTEL_ATTRIBUTE_VALUE_LENGTH_LIMIT, as the SDK reads "
        "them; else none)",
    )
    check.set_defaults(run=run_check)

    rules = commands.add_parser(
        "rules",
        help="list the rule catalogue",
        description="List the rule catalogue. --format markdown prints the rule reference, docs/rules.md.",
    )
    rules.add_argument(
        "--format",
        choices=("text", "json", "markdown"),
        default="text",
        help="output format (default: text; markdown is the full reference)",
    )
    rules.set_defaults(run=run_rules)

    prove = commands.add_parser(
        "prove",
        help="kill an agent at every action boundary, resume it, and check it came back",
        description="Run COMMAND to the end once, then kill it (SIGKILL) at each action boundary, run it "
        "again to resume, and check the spans of both runs with every rule. In COMMAND's arguments "
        "{journal}, {traces} and {dir} stand for the trial's journal file, OTLP/JSON trace file and "
        "directory (also in its environment as DURABLE_SESSIONS_JOURNAL, DURABLE_SESSIONS_TRACES, "
        "DURABLE_SESSIONS_DIR).",
        epilog="Exit 0: every crash point resumed cleanly; 1: at least one did not, or the reference run "
        "breaks rules; 2: usage error, or the reference run failed, wrote no spans, ran no action or ran "
        "actions without a session.",
    )
    prove.add_argument("command", nargs=argparse.REMAINDER, metavar="-- COMMAND [ARG ...]")
    prove.add_argument(
        "--dir",
        default=None,
        metavar="DIR",
        help="where trials keep their state (default: a new temporary one)",
    )
    prove.add_argument(
        "--points",
        type=_crash_points,
        default=crash.POINTS,
        metavar="P[,P]",
        help="crash points: before (journaled, not run), after (run, not journaled) (default: both)",
    )
    prove.add_argument(
        "--timeout-s",
        type=_positive_seconds,
        default=DEFAULT_TIMEOUT_S,
        metavar="N",
        help="per run (default: 120)",
    )
    prove.add_argument(
        "--max-actions",
        type=_positive_int,
        default=DEFAULT_MAX_BOUNDARIES,
        metavar="N",
        help="kill at most at the first N action boundaries (default: 200)",
    )
    prove.add_argument("--strict", action="store_true", help="also run strict-only rules (dead-end)")
    prove.add_argument(
        "--format", choices=("text", "json"), default="text", help="output format (default: text)"
    )
    prove.set_defaults(run=run_prove)

    _journal_parser(commands)

    explain = commands.add_parser("explain", help="explain one rule")
    explain.add_argument("rule", metavar="RULE", help="a rule id, e.g. unkeyed-side-effect")
    explain.set_defaults(run=run_explain)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    return run_command(f"durable-sessions {args.subcommand}", lambda out: args.run(args, out))


def run_check(args: argparse.Namespace, out: Output) -> int:
    try:
        rules = select_rules(args.rules, strict=args.strict, disable=args.disable)
    except KeyError as error:
        print(f"durable-sessions check: --disable: {error.args[0]}", file=sys.stderr)
        return EXIT_USAGE
    try:
        limit = args.attribute_value_limit or sdk_attribute_value_limit()
    except ValueError as error:
        print(f"durable-sessions check: {error}", file=sys.stderr)
        return EXIT_USAGE
    # Every worker reads every line: workers beyond the cores only add to the work
    # (--jobs 1000 made a 25 MB check take minutes, and could run out of descriptors).
    jobs = (
        min(args.jobs, usable_cores())
        if args.jobs is not None
        else default_jobs(args.files, args.input_format)
    )
    if args.format != "text" and hasattr(sys.stdout, "reconfigure"):
        # JSON is UTF-8 (RFC 8259) whatever the locale; a file name that is not UTF-8
        # comes out as a JSON escape, not as bytes that break the document.
        sys.stdout.reconfigure(encoding="utf-8", errors="backslashreplace")
    summary = Summary(fail_on=args.fail_on)
    collected: list[Violation] = []
    stderr = sys.stderr
    # Progress overwrites one line, with escape codes a dumb terminal would print.
    showing = stderr is not None and stderr.isatty() and os.environ.get("TERM") != "dumb"
    progress = _TerminalProgress(stderr) if showing else None
    run = OfflineCheck(
        args.files,
        rules,
        key_window_s=args.key_window_s,
        fmt=args.input_format,
        max_line_bytes=args.max_line_bytes,
        jobs=jobs,
        progress=progress,
        start_method=cli_start_method(),
        intents=args.intents,
        attribute_value_limit=limit,
    )
    try:
        with cyclic_gc_paused():
            for violation in run:
                summary.add(violation)
                if args.format == "text":
                    if progress:  # on a terminal stdout and stderr share the line
                        progress.clear()
                    out.write(text_line(violation) + "\n")
                else:
                    collected.append(violation)
    except InputError as error:
        if progress:
            progress.clear()
        print(f"durable-sessions check: {error}", file=sys.stderr)
        return EXIT_USAGE
    finally:
        if progress:  # also when interrupted: the shell's prompt comes next
            progress.clear()
    if args.format == "text":
        write_text_summary(out, summary, run.actions, run.sessions)
    elif args.format == "json":
        dump_json(json_document(collected, summary, run.actions, run.sessions), out)
    else:
        dump_json(sarif_document(collected, rules), out)
    if run.actions == 0:
        print("durable-sessions check: warning: no actions found in the input", file=sys.stderr)
    return EXIT_VIOLATIONS if summary.failed else EXIT_OK


def run_rules(args: argparse.Namespace, out: Output) -> int:
    if args.format == "markdown":
        out.write(rules_markdown(CATALOGUE))
        return EXIT_OK
    if args.format == "json":
        rows = [
            {
                "id": r.id,
                "severity": r.severity.value,
                "scope": r.scope,
                "summary": r.summary,
                "fix": r.fix,
                "seed": r.seed,
                "strict_only": r.strict_only,
                "at_session_end": r.at_session_end,
            }
            for r in CATALOGUE
        ]
        json.dump(rows, out, indent=2)  # type: ignore[arg-type]
        out.write("\n")
        return EXIT_OK
    width = max(len(r.id) for r in CATALOGUE)
    for rule in CATALOGUE:
        tags = "".join(
            f" [{tag}]"
            for tag, on in (("seed", rule.seed), ("strict", rule.strict_only), ("end", rule.at_session_end))
            if on
        )
        out.write(f"{rule.id:<{width}}  {rule.severity.value:<7}  {rule.summary}{tags}\n")
    return EXIT_OK


def run_prove(args: argparse.Namespace, out: Output) -> int:
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        print("durable-sessions prove: give the agent's command after --", file=sys.stderr)
        return EXIT_USAGE
    with contextlib.ExitStack() as stack:
        directory = args.dir or stack.enter_context(
            tempfile.TemporaryDirectory(prefix="durable-sessions-prove-")
        )
        try:
            proof = prove(
                command,
                directory,
                points=args.points,
                rules=select_rules(strict=args.strict),
                timeout_s=args.timeout_s,
                max_boundaries=args.max_actions,
            )
        except FileExistsError as error:
            print(
                f"durable-sessions prove: --dir {args.dir}: {error.filename} exists already", file=sys.stderr
            )
            return EXIT_USAGE
        except (OSError, InputError) as error:
            print(f"durable-sessions prove: {error}", file=sys.stderr)
            return EXIT_USAGE
        if args.format == "json":
            dump_json(proof_document(proof), out)  # type: ignore[arg-type]
        else:
            for line in describe(proof):
                out.write(line + "\n")
    if proof.reference.problems:
        return EXIT_USAGE
    return EXIT_OK if proof.passed else EXIT_VIOLATIONS


def _journal_parser(commands: Any) -> None:
    text = "inspect a record/replay journal, and settle actions in doubt"
    journal = commands.add_parser(
        "journal",
        help=text,
        description=text,
        epilog="Exit 0: done; 1: no such action, resolve of one with a recorded outcome, or a session open in a live "
        "process; 2: usage error, OUTCOME_JSON that is not JSON, or no journal at FILE.",
    )
    which = journal.add_subparsers(dest="journal_command", required=True, metavar="COMMAND")
    listing = which.add_parser("list", help="the journal's entries, in the order they were first journaled")
    listing.add_argument("file", metavar="FILE")
    listing.add_argument("--session", help="only this session")
    listing.add_argument(
        "--status",
        choices=("started", "ok", "error"),
        help="only this status (started: running in a live process, shown 'started (live)'; in doubt; or cut short)",
    )
    listing.add_argument(
        "--format", choices=("text", "json"), default="text", help="output format (default: text)"
    )
    resolve = which.add_parser(
        "resolve",
        help="record that an action in doubt did happen, with its outcome: it is replayed from now on",
    )
    discard = which.add_parser("discard", help="forget an action: the next run runs it again")
    for command in (resolve, discard):
        command.add_argument("file", metavar="FILE")
        command.add_argument("session", metavar="SESSION")
        command.add_argument("action", metavar="ACTION")
    resolve.add_argument(
        "outcome", metavar="OUTCOME_JSON", help="the outcome as JSON text, e.g. '{\"charged\": 2400}'"
    )
    journal.set_defaults(run=run_journal)


def run_journal(args: argparse.Namespace, out: Output) -> int:
    name = f"durable-sessions journal {args.journal_command}"
    try:
        journal = SqliteJournal.existing(args.file, readonly=args.journal_command == "list")
    except (FileNotFoundError, ValueError) as error:
        print(f"{name}: {error}", file=sys.stderr)
        return EXIT_USAGE
    try:
        if args.journal_command == "list":
            # The table shows digests: the outcomes themselves (kept in full) stay on disk.
            entries = journal.entries(args.session, status=args.status, outcomes=args.format == "json")
            for line in _journal_lines(entries, args.format, _live_sessions(journal, entries, name)):
                out.write(line + "\n")
            return EXIT_OK
        if args.journal_command == "resolve":
            try:
                outcome = json.loads(args.outcome, parse_constant=_not_json)
                entry = journal.resolve(args.session, args.action, outcome)
            except AlreadyCompleted as error:
                print(f"{name}: {printable(str(error))}", file=sys.stderr)
                return EXIT_VIOLATIONS
            except (ValueError, RecursionError) as error:
                print(f"{name}: OUTCOME_JSON is not JSON: {error or 'nested too deeply'}", file=sys.stderr)
                return EXIT_USAGE
            out.write(
                f"{printable(entry.action_id)} of session {printable(entry.session_id)}: ok, replayed from now on\n"
            )
        else:
            journal.discard(args.session, args.action)
            out.write(
                f"{printable(args.action)} of session {printable(args.session)}: forgotten, runs again\n"
            )
        return EXIT_OK
    except SessionLive as error:
        print(f"{name}: {printable(str(error))}", file=sys.stderr)
        return EXIT_VIOLATIONS
    except KeyError as error:
        print(f"{name}: {printable(str(error.args[0]))}", file=sys.stderr)
        return EXIT_VIOLATIONS
    except sqlite3.Error as error:
        print(f"{name}: {args.file}: {error}", file=sys.stderr)
        return EXIT_USAGE
    finally:
        journal.close()


def _not_json(constant: str) -> None:
    raise ValueError(f"{constant} is no JSON number")


def _live_sessions(journal: SqliteJournal, entries: list[Entry], name: str) -> set[str] | None:
    """The sessions of ``entries`` that a live process has open; None (said on stderr)
    when the lock file cannot be read."""
    try:
        return journal.live_sessions({entry.session_id for entry in entries})
    except OSError as error:
        print(f"{name}: cannot tell which sessions a live process has open: {error}", file=sys.stderr)
        return None


def _journal_lines(entries: list[Entry], fmt: str, live: set[str] | None) -> Iterator[str]:
    """The listing; ``live``: the sessions a live process has open (None: not known), whose
    ``started`` actions are running, not in doubt."""
    if fmt == "json":  # ASCII: an outcome may hold a lone surrogate, which no encoding writes
        yield json.dumps([_entry_document(entry, live) for entry in entries], indent=2)
        return
    if not entries:
        yield "no entries"
        return
    rows = [("SESSION", "ACTION", "KIND", "STATUS", "ATTEMPTS", "KEY", "OUTCOME")]
    for entry in entries:
        outcome = entry.result_digest or ("by reference" if entry.result_ref else "-")
        status = entry.status
        if status == "started" and live is not None and entry.session_id in live:
            status = "started (live)"
        cells = (entry.session_id, entry.action_id, entry.kind, status, str(entry.attempts))
        rows.append((*map(printable, cells), printable(entry.idempotency_key or "-"), outcome))
    yield from table_lines(rows)


def _entry_document(entry: Entry, live: set[str] | None) -> dict[str, Any]:
    document: dict[str, Any] = dataclasses.asdict(entry)
    document["result"] = None if entry.result is None else entry.result.decode("utf-8", "surrogatepass")
    document["live"] = None if live is None else entry.session_id in live
    return document


def _crash_points(text: str) -> tuple[str, ...]:
    points = tuple(dict.fromkeys(part.strip() for part in text.split(",")))
    for point in points:
        if point not in crash.POINTS:
            raise argparse.ArgumentTypeError(f"{point!r} is not a crash point ({', '.join(crash.POINTS)})")
    return points


def run_explain(args: argparse.Namespace, out: Output) -> int:
    if args.rule not in CATALOGUE:
        print(
            f"durable-sessions explain: unknown rule {args.rule!r}; see 'durable-sessions rules'",
            file=sys.stderr,
        )
        return EXIT_USAGE
    out.write(explain_markdown(CATALOGUE.get(args.rule)))
    return EXIT_OK


class _TerminalProgress:
    """A self-overwriting progress line on a terminal, at most a few times a second."""

    def __init__(self, stream: TextIO) -> None:
        self.stream = stream
        self.last = time.monotonic()
        self.shown = False

    def __call__(self, path: str, done: int, size: int | None) -> None:
        now = time.monotonic()
        if now - self.last < 0.5:
            return
        self.last = now
        total = f" of {size / 1e6:.0f} MB" if size else ""
        self.stream.write(f"\r\033[Kchecking {path}: {done / 1e6:.0f} MB{total}")
        self.stream.flush()
        self.shown = True

    def clear(self) -> None:
        if self.shown:
            self.stream.write("\r\033[K")
            self.stream.flush()
            self.shown = False


def _positive_seconds(text: str) -> float:
    """A duration flag, checked as the span processor checks its settings (a finite number
    above 0); argparse shows the error after the flag's name."""
    try:
        return positive_seconds_from_text(text)
    except ValueError as reason:
        raise argparse.ArgumentTypeError(f"{text!r} {reason}") from None


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive integer")
    if value > sys.maxsize // 2:  # a read size must fit a C ssize_t (it was an OverflowError)
        raise argparse.ArgumentTypeError(f"{text!r} is too large")
    return value


if __name__ == "__main__":
    sys.exit(main())
