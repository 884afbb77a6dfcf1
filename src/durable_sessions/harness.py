"""The kill-and-resume harness: prove that an agent comes back where it was.

:func:`prove` runs an agent command once to the end (the reference), then, for every
action boundary ``n`` and crash point (:mod:`durable_sessions.crash`), in a fresh
directory:

1. runs the command with ``DURABLE_SESSIONS_KILL_AT=<point>:<n>``, so the process kills
   itself with ``SIGKILL`` at that boundary;
2. runs the command again, which must resume the session and finish (exit 0);
3. checks the spans both processes exported with the given rules (the same engine as
   ``durable-sessions check``): nothing the journal recorded asked or charged again, no
   outcome that diverged from its record;
4. checks that every action the reference completed was completed here too, or stepped
   over as a ``replay="skip"`` side effect in doubt, or ran inside one in the reference
   (reported apart: at ``before`` its effect is dropped, which is what ``skip`` means,
   with the actions its body ran). A trial is an execution of its own:
   where an action got another outcome than in the reference (a model's answer) and the
   trial then ran actions the reference never did (a tool call named by the model), the
   reference's actions that started after that one are not compared (reported apart too).

The boundaries are those the reference run passed (every action it ran), counted by the
instrumentation itself. The command runs in the current directory and finds where to
keep its state through placeholders in its arguments, or the same values in its
environment:

============  ===============================  =========================================
placeholder   environment variable             value
============  ===============================  =========================================
``{journal}`` ``DURABLE_SESSIONS_JOURNAL``     the trial's journal file (SQLite)
``{traces}``  ``DURABLE_SESSIONS_TRACES``      the OTLP/JSON file its spans go to
``{dir}``     ``DURABLE_SESSIONS_DIR``         the trial's directory, for other state
(none)        ``DURABLE_SESSIONS_RESULT_DIR``  ``results`` in the trial's directory, for
                                               results too long for a span (unless the
                                               environment sets it already)
============  ===============================  =========================================

The agent writes its spans with :class:`~durable_sessions.otlp_json.FileSpanExporter`
under a ``SimpleSpanProcessor`` (every ended span on disk at once), and keeps its
session id the same across runs, as a resumed agent must.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import signal
import subprocess
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import IO, Any

from durable_sessions import crash, disk
from durable_sessions.check import check_paths, offline_checker, sdk_attribute_value_limit
from durable_sessions.engine import UNREADABLE_LINE
from durable_sessions.instrument import RESULT_DIR_ENV
from durable_sessions.otlp_json import field
from durable_sessions.readers import Item, Unreadable, open_source, parse_object, read
from durable_sessions.report import printable, text_line
from durable_sessions.rules import Rule
from durable_sessions.violation import Severity, Violation

JOURNAL_ENV = "DURABLE_SESSIONS_JOURNAL"
TRACES_ENV = "DURABLE_SESSIONS_TRACES"
DIR_ENV = "DURABLE_SESSIONS_DIR"
DEFAULT_TIMEOUT_S = 120.0
DEFAULT_MAX_BOUNDARIES = 200
_OUTPUT_TAIL_CHARS = 2000


@dataclasses.dataclass(frozen=True)
class Run:
    """One process of a trial."""

    returncode: int | None
    """``None`` when it ran past the timeout and was killed."""
    seconds: float
    output: str
    """The end of what it printed (standard output and error), for a failure message."""

    @property
    def killed_at_crash_point(self) -> bool:
        """Killed by ``SIGKILL``: directly, or as a shell or launcher reports it (128 + 9)."""
        return self.returncode in (-signal.SIGKILL, 128 + signal.SIGKILL)


@dataclasses.dataclass
class Trial:
    """The reference run, or one crash at one boundary and the resume after it."""

    name: str
    directory: Path
    runs: list[Run] = dataclasses.field(default_factory=list)
    violations: list[Violation] = dataclasses.field(default_factory=list)
    problems: list[str] = dataclasses.field(default_factory=list)
    completed: set[tuple[str, str]] = dataclasses.field(default_factory=set)
    """``(session id, action id)`` of every action with a recorded ``ok``."""
    stepped_over: set[tuple[str, str]] = dataclasses.field(default_factory=set)
    """Actions the resumed run stepped over as ``replay="skip"`` side effects in doubt:
    accounted for, not completed (at ``before`` the effect was dropped, at most once)."""
    dropped_inside: dict[tuple[str, str], set[tuple[str, str]]] = dataclasses.field(default_factory=dict)
    """For each action stepped over that ran actions inside it in the reference, those of
    them this trial never completed: dropped with it (its body did not run again)."""
    reached: bool = True
    """False when the crash point was never reached (the agent ran fewer actions)."""
    path_changed_after: tuple[str, str] | None = None
    """The reference's first action (by start) that got another outcome in this trial."""
    own_path: set[tuple[str, str]] = dataclasses.field(default_factory=set)
    """Actions this trial ran that the reference never did, once its path changed there."""
    another_path: set[tuple[str, str]] = dataclasses.field(default_factory=set)
    """Actions the reference completed, started after :attr:`path_changed_after`, that this
    trial never completed, having run :attr:`own_path` instead: not compared."""
    cut_by_the_kill: int | None = None
    """The line of the traces the kill cut short (a span being written as it came), whose
    ``unreadable-line`` is the crash's own mark and is not held against the agent."""

    @property
    def errors(self) -> list[Violation]:
        return [v for v in self.violations if v.severity is Severity.ERROR]

    @property
    def passed(self) -> bool:
        """No problem and no error; a crash point never reached passes (nothing to prove)."""
        return not self.problems and not self.errors


@dataclasses.dataclass
class Proof:
    """Everything :func:`prove` found."""

    reference: Trial
    trials: list[Trial] = dataclasses.field(default_factory=list)
    boundaries: int = 0
    """How many action boundaries the reference run passed (actions it ran)."""
    tested: int = 0
    """How many of them were crash-tested (fewer when ``max_boundaries`` cut the proof short)."""

    @property
    def passed(self) -> bool:
        return self.reference.passed and all(t.passed for t in self.trials)


def prove(
    command: Sequence[str],
    directory: str | os.PathLike[str],
    *,
    points: Sequence[str] = crash.POINTS,
    rules: Sequence[Rule] | None = None,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    max_boundaries: int = DEFAULT_MAX_BOUNDARIES,
    env: Mapping[str, str] | None = None,
) -> Proof:
    """Kill ``command`` at every action boundary, resume it, and check what it did.

    ``directory`` receives one folder per trial (``reference``, ``before-1``,
    ``after-1``, …) with its journal, traces, output and whatever else the agent keeps
    there; it must not hold an earlier proof's folders. The command runs in the current
    directory. A failing reference run ends the proof early: its problems say why.
    """
    unknown = sorted(set(points) - set(crash.POINTS))
    if not points or unknown:
        raise ValueError(f"unknown crash point {', '.join(unknown)}; expected {', '.join(crash.POINTS)}")
    base = Path(directory).resolve()
    environment = dict(os.environ if env is None else env)
    environment.pop(crash.ENV, None)
    environment.pop(crash.COUNT_ENV, None)
    reference = _Runner(command, base / "reference", environment, timeout_s)
    proof = Proof(reference.trial)
    reference.run_to_end("the reference run")
    proof.boundaries, returned = reference.boundaries(1)
    if reference.trial.problems:
        return proof
    if proof.boundaries == 0:
        reference.trial.problems.append(reference.why_no_action())
        return proof
    reference_records = reference.check(rules, expected=None, ran=proof.boundaries)
    if reference.trial.problems:
        return proof
    expected = _Reference(reference_records, _enclosing(reference.paths["traces"]))
    proof.tested = min(proof.boundaries, max_boundaries)
    for boundary in range(1, proof.tested + 1):
        for point in dict.fromkeys(points):
            trial = Trial(f"{point}-{boundary}", base / f"{point}-{boundary}")
            if point == "after" and boundary not in returned:
                trial.reached = False  # the reference's action raised: there is no after point
            else:
                trial = _crash_trial(command, base, environment, timeout_s, point, boundary, rules, expected)
            proof.trials.append(trial)
    return proof


def _crash_trial(
    command: Sequence[str],
    base: Path,
    environment: dict[str, str],
    timeout_s: float,
    point: str,
    boundary: int,
    rules: Sequence[Rule] | None,
    reference: _Reference,
) -> Trial:
    runner = _Runner(command, base / f"{point}-{boundary}", environment, timeout_s)
    killed = runner.run({crash.ENV: f"{point}:{boundary}"})
    if killed.killed_at_crash_point:
        cut = _line_cut_short(runner.paths["traces"])
        runner.run_to_end("the resumed run")
        runner.trial.cut_by_the_kill = _still_alone(runner.paths["traces"], cut)
        runner.check(rules, expected=reference, ran=None)
    elif killed.returncode == 0:
        runner.trial.problems.append(
            f"the run was not killed at {point} action {boundary}: it ran fewer actions than the reference run. "
            "Is its journal the trial's ({journal}, $DURABLE_SESSIONS_JOURNAL) rather than a fixed path earlier "
            "runs filled? Do actions that run at the same time start in another order than in the reference?"
        )
    else:
        runner.trial.problems.append(_failed("the run to be killed", killed))
    return runner.trial


class _Runner:
    """Runs a trial's processes and checks what they exported.

    Each process runs in a session of its own, its output going to a file in the trial's
    directory (``run-1.log``, …): a helper process the agent started, still holding
    the output after the agent was killed, neither keeps the harness waiting nor
    outlives the run (the whole process group is killed when the agent ends).
    """

    def __init__(
        self, command: Sequence[str], directory: Path, environment: dict[str, str], timeout_s: float
    ):
        directory.mkdir(parents=True, exist_ok=False)
        self.trial = Trial(directory.name, directory)
        self.paths = {
            "journal": str(directory / "journal.db"),
            "traces": str(directory / "traces.jsonl"),
            "dir": str(directory),
        }
        self.argv = [_substituted(arg, self.paths) for arg in command]
        self.environment = {
            # Results too long for a span stay with the trial (the default store is in the
            # current directory, which every trial shares and the proof leaves behind),
            # unless the user chose where they go.
            **environment,
            RESULT_DIR_ENV: environment.get(RESULT_DIR_ENV) or str(directory / "results"),
            JOURNAL_ENV: self.paths["journal"],
            TRACES_ENV: self.paths["traces"],
            DIR_ENV: self.paths["dir"],
        }
        self.timeout_s = timeout_s

    def run(self, extra_env: Mapping[str, str] | None = None) -> Run:
        number = len(self.trial.runs) + 1
        log = self.trial.directory / f"run-{number}.log"
        counting = {crash.COUNT_ENV: str(self._count_file(number))}
        started = time.monotonic()
        with open(log, "wb") as output:
            try:
                returncode = _ran(
                    self.argv, {**self.environment, **counting, **(extra_env or {})}, output, self.timeout_s
                )
            except OSError as error:
                output.write(f"could not start {self.argv[0]}: {error.strerror or error}".encode())
                returncode = _NOT_STARTED
        run = Run(returncode, time.monotonic() - started, _tail(log))
        self.trial.runs.append(run)
        return run

    def _count_file(self, run: int) -> Path:
        return self.trial.directory / f"boundaries-{run}"

    def boundaries(self, run: int) -> tuple[int, set[int]]:
        """How many action boundaries run ``run`` passed, and which of them it returned from."""
        return crash.counted(self._count_file(run))

    def run_to_end(self, what: str, extra_env: Mapping[str, str] | None = None) -> None:
        run = self.run(extra_env)
        if run.returncode != 0:
            self.trial.problems.append(_failed(what, run))

    def why_no_action(self) -> str:
        """The problem of a run that passed no action boundary: none ran, or every one it
        reached was replayed, from a journal that is not the trial's."""
        traces = self.paths["traces"]
        replayed = (
            sorted({str(r["action_id"]) for r in _records(traces) if r.get("replayed") is True})
            if os.path.isfile(traces)
            else []
        )
        if not replayed:
            return (
                "the agent ran no action of durable_sessions.instrument: there is no boundary to kill it at"
            )
        listed = ", ".join(replayed[:10]) + (f" and {len(replayed) - 10} more" if len(replayed) > 10 else "")
        return (
            f"the agent ran no action: it replayed every one it reached ({listed}) from a journal that is not "
            "the trial's: keep it at {journal} ($DURABLE_SESSIONS_JOURNAL), not at a fixed path earlier runs filled"
        )

    def check(
        self, rules: Sequence[Rule] | None, expected: _Reference | None, ran: int | None
    ) -> list[dict[str, Any]]:
        """Check the trial's spans, against the reference (``expected``) for a crash
        trial; ``ran``: how many actions the run passed, for the reference. Returns the
        trial's records."""
        traces = self.paths["traces"]
        if not os.path.isfile(traces):
            self.trial.problems.append(
                f"no spans were written to {traces}: export them with FileSpanExporter"
            )
            return []
        # The limit the agent's SDK cut results at: a result cut there is a truncated-result.
        try:
            limit = sdk_attribute_value_limit(self.environment)
        except ValueError:  # the agent's own SDK refused it: the run said so
            limit = None
        found = list(check_paths([traces], offline_checker(rules), attribute_value_limit=limit))
        self.trial.violations = [violation for violation in found if not self._cut_by_the_kill(violation)]
        if len(self.trial.violations) == len(found):  # the cut line lacked only its line break: it read
            self.trial.cut_by_the_kill = None
        records = list(_records(traces))
        self.trial.completed = _actions(records, status="ok")
        if ran:
            self._check_reference(records, ran, traces)
        if expected is not None:
            completed = _actions(expected.records, status="ok")
            # An action in doubt that is replay="skip" is stepped over by design: its span
            # stays `started`, and the proof reports it apart rather than as lost; so are
            # the actions its body ran, which does not run again.
            stepped = (_actions(records, status="started", replay="skip") & completed) - self.trial.completed
            self.trial.stepped_over = stepped
            unmet = completed - self.trial.completed - stepped
            self.trial.dropped_inside = {
                outer: {key for key in unmet if outer in expected.enclosing.get(key, ())}
                for outer in stepped
                if any(outer in around for around in expected.enclosing.values())
            }
            unmet -= set().union(*self.trial.dropped_inside.values())
            self.trial.path_changed_after, self.trial.own_path, self.trial.another_path = _another_path(
                expected.records, records, unmet
            )
            missing = unmet - self.trial.another_path
            if missing:
                self.trial.problems.append(
                    f"did not come back where it was: the reference completed {_listed(missing)}, this trial never did"
                )
        return records

    def _cut_by_the_kill(self, violation: Violation) -> bool:
        """Whether ``violation`` says only that the line the kill cut short does not read."""
        return (
            violation.rule == UNREADABLE_LINE.id
            and violation.line is not None
            and violation.line == self.trial.cut_by_the_kill
            and violation.file == self.paths["traces"]
        )

    def _check_reference(self, records: list[dict[str, Any]], ran: int, traces: str) -> None:
        """What makes a reference run useless to compare with: spans that never reached the
        file, or actions without a session, which a resumed run cannot find in the journal."""
        if not records:
            self.trial.problems.append(
                f"the reference ran {ran} actions but {traces} holds none of them: the FileSpanExporter must be "
                "on the provider the actions use (trace.set_tracer_provider(provider))"
            )
        sessionless = sorted(
            {r["action_id"] for r in records if r.get("session_source") is not None}, key=str
        )
        if sessionless:
            listed = ", ".join(map(str, sessionless[:10]))
            self.trial.problems.append(
                f"actions ran without a session id ({listed}): their session is their trace, which a resumed run "
                "cannot find again; run them inside session(...) (a thread needs the context copied)"
            )


@dataclasses.dataclass(frozen=True)
class _Reference:
    """What a crash trial is compared with: the reference run's records, and for each of
    its actions those whose span its own ran inside (its enclosing actions)."""

    records: list[dict[str, Any]]
    enclosing: dict[tuple[str, str], set[tuple[str, str]]]


def _enclosing(traces: str) -> dict[tuple[str, str], set[tuple[str, str]]]:
    """For each action of a run's spans, the actions whose spans its spans ran inside."""
    parents = _parent_spans(traces)
    action_of = {
        span_id: (record["session_id"], record["action_id"])
        for record, span_id in _located(traces)
        if record.get("session_source") is None and span_id is not None
    }
    enclosing: dict[tuple[str, str], set[tuple[str, str]]] = {}
    for span_id, key in action_of.items():
        around = enclosing.setdefault(key, set())
        seen = {span_id}
        parent = parents.get(span_id)
        while parent is not None and parent not in seen:  # a file written by hand may loop
            seen.add(parent)
            if parent in action_of:
                around.add(action_of[parent])
            parent = parents.get(parent)
    return enclosing


def _line_cut_short(traces: str) -> tuple[int, int] | None:
    """Where a killed run left its traces mid-line: the number of that last line and the
    file's size (where the line stops); None when the file ends with a whole line.

    ``SIGKILL`` stops a long ``write`` between pages: a span a thread (or a worker
    process) of the agent was writing when the crash came is cut short. That is the
    crash's doing, as a machine going down would do it, not a fault of the agent.
    """
    if not disk.ends_mid_line(traces):
        return None
    breaks = 0
    with open(traces, "rb") as lines:
        while chunk := lines.read(1 << 20):
            breaks += chunk.count(b"\n")
        return breaks + 1, lines.tell()


def _still_alone(traces: str, cut: tuple[int, int] | None) -> int | None:
    """The number of the line the kill cut short, if it is still a line of its own once
    the resumed run has written: the resumed run's first line begins after a line break
    (as :class:`~durable_sessions.otlp_json.FileSpanExporter` writes one) rather than
    running on from the cut one, which would take spans of the resumed run with it."""
    if cut is None:
        return None
    line, size = cut
    with open(traces, "rb") as after:
        after.seek(size)
        return line if after.read(1) in (b"", b"\n") else None


def _parent_spans(traces: str) -> dict[str, str]:
    """Span id → parent span id, of the spans of an OTLP/JSON file (ids in lowercase hex,
    as the reader gives them); what does not read is left out."""
    parents: dict[str, str] = {}
    with open(traces, "rb") as lines:
        for line in lines:
            request = parse_object(line)
            for group in _listed_under(request, "resourceSpans", "resource_spans"):
                for scope in _listed_under(group, "scopeSpans", "scope_spans"):
                    for span in _listed_under(scope, "spans", "spans"):
                        span_id = field(span, "spanId", "span_id")
                        parent = field(span, "parentSpanId", "parent_span_id")
                        if isinstance(span_id, str) and isinstance(parent, str) and parent:
                            parents[span_id.lower()] = parent.lower()
    return parents


def _listed_under(node: Any, camel: str, snake: str) -> Iterator[dict[str, Any]]:
    """The objects in ``node``'s list field (either spelling); none where it is no list."""
    value = field(node, camel, snake) if isinstance(node, dict) else None
    return (item for item in value if isinstance(item, dict)) if isinstance(value, list) else iter(())


def _actions(records: list[dict[str, Any]], **fields: str) -> set[tuple[str, str]]:
    """``(session id, action id)`` of the records with a session id that have ``fields``."""
    return {
        (r["session_id"], r["action_id"])
        for r in _sessioned(records)
        if all(r.get(name) == value for name, value in fields.items())
    }


def _another_path(
    reference: list[dict[str, Any]], trial: list[dict[str, Any]], unmet: set[tuple[str, str]]
) -> tuple[tuple[str, str] | None, set[tuple[str, str]], set[tuple[str, str]]]:
    """Where this trial's path left the reference's: the reference's first action (by
    start) whose outcome the trial got otherwise, the actions the trial ran that the
    reference never did, and the ``unmet`` ones that started after it in the reference.

    A trial is an execution of its own: every action its killed run ran, and those its
    resumed run ran afresh, may get another outcome than in the reference (a model's
    answer), and what the agent does next may then differ, down to the ids of its next
    actions (a tool call named by the model). Where the trial did run actions of its own,
    the reference's later ones cannot be looked for by id; where it ran none, a later
    action it never completed is work it did not come back to, whatever the outcomes.
    """
    started: dict[tuple[str, str], int] = {}
    recorded: dict[tuple[str, str], set[Any]] = {}
    for record in _sessioned(reference):
        key = (record["session_id"], record["action_id"])
        seq = record.get("seq")
        if type(seq) is int:
            started[key] = min(seq, started.get(key, seq))
        if record.get("status") == "ok" and record.get("result_digest") is not None:
            recorded.setdefault(key, set()).add(record["result_digest"])
    differs = {
        key
        for record in _sessioned(trial)
        if record.get("status") == "ok"
        and (key := (record["session_id"], record["action_id"])) in recorded
        and key in started
        and record.get("result_digest") is not None
        and record["result_digest"] not in recorded[key]
    }
    own = _actions(trial) - _actions(reference)
    if not differs or not own:
        return None, set(), set()
    first = min(differs, key=started.__getitem__)
    return first, own, {key for key in unmet if started.get(key, -1) > started[first]}


def _sessioned(records: list[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    """The records of actions with a session id (those a resumed run can find again)."""
    return (r for r in records if r.get("session_source") is None)


_NOT_STARTED = 127  # as a shell reports a command it could not run


def _ran(argv: Sequence[str], env: Mapping[str, str], output: IO[bytes], timeout_s: float) -> int | None:
    """Run ``argv`` in a session of its own, its output to ``output``: its exit status
    (``None`` past the timeout). Raises ``OSError`` when it cannot be started.

    Its process group is killed however the run ends, an interrupt of the harness (Ctrl-C,
    SIGTERM) included: the run is a session of its own, which a terminal's signal never
    reaches, and would go on unsupervised in a directory the proof then deletes.
    """
    process = None
    try:
        # An interrupt acted on inside Popen once the child is started left no process
        # to kill: it waits until the process is held.
        with _interrupts_held():
            process = subprocess.Popen(
                argv,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=output,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        return process.wait(timeout_s)
    except subprocess.TimeoutExpired:
        return None
    finally:
        if process is not None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(process.pid, signal.SIGKILL)
            _reap(process)


def _reap(process: subprocess.Popen[bytes]) -> None:
    """Wait for ``process`` (killed) to end, and keep its status as ``process.wait()`` does.

    Not ``process.wait()``: its timed wait takes a lock with ``acquire(False)`` just
    before the ``try`` that releases it, and an interrupt acted on between the two leaves
    the lock held, on which ``wait()`` then waited for ever.
    """
    if process.returncode is not None:
        return
    try:
        _, status = os.waitpid(process.pid, 0)
    except ChildProcessError:  # reaped by the wait the interrupt cut short
        return
    process.returncode = os.waitstatus_to_exitcode(status)


@contextlib.contextmanager
def _interrupts_held() -> Iterator[None]:
    """Run the block with SIGINT and SIGTERM held back, then act on one that came meanwhile
    (its handler runs as the block ends, as it would have run in it)."""
    came: list[int] = []
    with _held(signal.SIGINT, came), _held(signal.SIGTERM, came):
        yield
    if came:
        signal.raise_signal(came[0])


@contextlib.contextmanager
def _held(number: int, came: list[int]) -> Iterator[None]:
    """Note signal ``number`` in ``came`` instead of running its handler while the block runs.

    Only a handler that is Python code is held, in the main thread, which alone runs
    them: ``SIG_IGN`` stays (a process started meanwhile inherits it), and ``SIG_DFL``
    ends this process at once whatever it is doing.
    """
    handler = signal.getsignal(number)
    if not callable(handler) or threading.current_thread() is not threading.main_thread():
        yield
        return
    signal.signal(number, lambda signum, frame: came.append(signum))
    try:
        yield
    finally:
        signal.signal(number, handler)


# -- reporting ------------------------------------------------------------------------------


def describe(proof: Proof) -> Iterator[str]:
    """The proof as text lines: each trial's verdict, then what failed and why."""
    reference = proof.reference
    if reference.problems:
        yield "reference run: FAILED"
    else:
        yield f"reference run: {proof.boundaries} actions ran, {len(reference.completed)} completed"
    yield from _details(reference)
    for trial in proof.trials:
        point, _, boundary = trial.name.partition("-")
        what = f"kill {point} action {boundary}"
        if not trial.reached:
            yield f"{what}: no such point (the reference run's action {boundary} did not return normally)"
            continue
        yield f"{what}: {'resumed' if trial.passed else 'FAILED'}"
        yield from _cut_by_the_kill_line(trial)
        yield from _stepped_over(trial, point)
        yield from _another_path_lines(trial)
        yield from _details(trial)
    yield _summary(proof)


def _summary(proof: Proof) -> str:
    reached = [t for t in proof.trials if t.reached]
    failed = sum(not t.passed for t in reached)
    summary = f"{len(reached)} crash points: {len(reached) - failed} resumed, {failed} failed"
    if proof.reference.problems:
        summary += "; the reference run failed"
    elif proof.reference.errors:
        summary += "; the reference run itself breaks rules"
    if not proof.reference.problems and proof.tested < proof.boundaries:  # cut short, not stopped early
        summary += (
            f"; only the first {proof.tested} of {proof.boundaries} actions were tested (--max-actions)"
        )
    return summary


def _cut_by_the_kill_line(trial: Trial) -> Iterator[str]:
    """A line saying which line of the traces the kill cut short, and that it is not held
    against the agent."""
    if trial.cut_by_the_kill is not None:
        yield (
            f"    traces.jsonl:{trial.cut_by_the_kill} was cut short by the kill (a span being written as it "
            "came): not held against the agent"
        )


def _stepped_over(trial: Trial, point: str) -> Iterator[str]:
    """A line per replay="skip" action the resumed run stepped over, saying what became of it."""
    fate = (
        "killed before it ran, so it never happened: replay=skip drops it (at most once)"
        if point == "before"
        else "it ran before the kill and was not repeated"
    )
    for outer in sorted(trial.stepped_over, key=str):
        session, action = outer
        line = (
            f"    stepped over (replay=skip): {printable(str(action))} (session {printable(str(session))}); "
        )
        if outer not in trial.dropped_inside:
            yield line + fate
            continue
        # Which of its boundaries, its own or an inner action's, the kill came at is not
        # known here: what is true at each of them.
        line += "killed before it ended: what of it ran before the kill happened once, the rest is dropped "
        line += "(replay=skip: at most once)"
        inside = trial.dropped_inside[outer]
        yield line + (
            f"; the actions inside it were not run again either: {printable(_listed(inside))}"
            if inside
            else ""
        )


def _another_path_lines(trial: Trial) -> Iterator[str]:
    """A line naming the reference's actions this trial's own path left uncompared."""
    if trial.path_changed_after is None or not trial.another_path:
        return
    session, action = trial.path_changed_after
    yield printable(  # ids are the agent's text: control characters shown escaped, as in problems
        f"    took another path after {action} (session {session}), whose outcome differs from the reference's, "
        f"to {_listed(trial.own_path)}: not compared: {_listed(trial.another_path)}"
    )


def _listed(actions: set[tuple[str, str]]) -> str:
    """``a1 (session s1), …`` for at most ten actions, and how many more."""
    ordered = sorted(actions, key=str)  # action ids a span sets itself may be numbers beside texts
    listed = ", ".join(f"{a} (session {s})" for s, a in ordered[:10])
    return listed + (f" and {len(ordered) - 10} more" if len(ordered) > 10 else "")


def _details(trial: Trial) -> Iterator[str]:
    for problem in trial.problems:
        first, *rest = problem.splitlines()
        yield f"    {printable(first)}"
        yield from (f"      | {printable(line)}" for line in rest)
    for violation in trial.violations:
        yield f"    {text_line(violation)}"


def proof_document(proof: Proof) -> dict[str, object]:
    """The proof as a JSON document."""
    return {
        "ok": proof.passed,
        "boundaries": proof.boundaries,
        "tested": proof.tested,
        "reference": _trial_document(proof.reference),
        "trials": [_trial_document(trial) for trial in proof.trials],
    }


def _trial_document(trial: Trial) -> dict[str, object]:
    return {
        "name": trial.name,
        "directory": str(trial.directory),
        "reached": trial.reached,
        "passed": trial.passed,
        "problems": trial.problems,
        "violations": [violation.as_dict() for violation in trial.violations],
        "returncodes": [run.returncode for run in trial.runs],
        "logs": [str(trial.directory / f"run-{n}.log") for n in range(1, len(trial.runs) + 1)],
        "completed": len(trial.completed),
        "cut_by_the_kill": trial.cut_by_the_kill,
        "stepped_over": [
            {
                "session_id": s,
                "action_id": a,
                "dropped_inside": [
                    {"session_id": si, "action_id": ai}
                    for si, ai in sorted(trial.dropped_inside.get((s, a), ()), key=str)
                ],
            }
            for s, a in sorted(trial.stepped_over, key=str)
        ],
        "path_changed_after": (
            None
            if trial.path_changed_after is None
            else dict(zip(("session_id", "action_id"), trial.path_changed_after, strict=True))
        ),
        "own_path": [{"session_id": s, "action_id": a} for s, a in sorted(trial.own_path, key=str)],
        "not_compared": [{"session_id": s, "action_id": a} for s, a in sorted(trial.another_path, key=str)],
    }


def _records(traces: str) -> Iterator[dict[str, Any]]:
    return (record for record, _ in _located(traces))


def _located(traces: str) -> Iterator[tuple[dict[str, Any], str | None]]:
    """The action records of an OTLP/JSON file, each with its span's id."""
    with open_source(traces) as source:
        items: Iterator[Item] = read(traces, source, fmt="otlp-json")
        for item in items:
            if type(item) is not Unreadable:
                record, location = item  # type: ignore[misc]
                yield record, location.span_id


def _tail(log: Path) -> str:
    """The end of a run's output, read from the end of its log: an agent that printed
    gigabytes (a debug log left on) must not have all of it read into memory."""
    with open(log, "rb") as output:
        size = output.seek(0, os.SEEK_END)
        output.seek(max(0, size - _OUTPUT_TAIL_CHARS * 4))  # 4: the most bytes a character takes
        return output.read().decode("utf-8", "replace")[-_OUTPUT_TAIL_CHARS:]


def _substituted(arg: str, paths: Mapping[str, str]) -> str:
    for name, value in paths.items():
        arg = arg.replace("{" + name + "}", value)
    return arg


def _failed(what: str, run: Run) -> str:
    if run.returncode is None:
        outcome = f"did not finish within {run.seconds:.0f} s"
    elif run.returncode < 0:
        outcome = f"was killed by signal {-run.returncode}"
    else:
        outcome = f"exited {run.returncode}"
    tail = run.output.strip()
    return f"{what} {outcome}" + (f"; it printed:\n{tail}" if tail else "")


__all__ = [
    "DIR_ENV",
    "JOURNAL_ENV",
    "TRACES_ENV",
    "Proof",
    "Run",
    "Trial",
    "describe",
    "proof_document",
    "prove",
]
