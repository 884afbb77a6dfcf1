"""A pytest plugin: durability violations of the spans a test ends.

Enable it with ``pytest -p durable_sessions.pytest_plugin`` (it is also registered under
the ``pytest11`` entry point, so installing the package enables it). It provides

- the ``durability`` fixture: a :class:`Durability` that collects the violations of spans
  ended during the test. Its :attr:`~Durability.processor` is already added to the global
  SDK ``TracerProvider`` when there is one; add it to any other provider the test builds.
  A global provider set during the test is attached when the test finishes, too late for
  the spans already ended: ``assert_clean()`` fails saying so (strict mode warns).
  At the end of the test every session is ended, so the end-of-session rules run per test.
- ``--durability=strict``: every test gets the collector, from the start of its set-up
  (so the spans its fixtures end count too) to the end of the test function, and a test
  whose spans break a rule fails, listing the violations. ``--durability=report`` (the default) only
  collects; ``--durability=off`` disables the plugin.

::

    def test_booking(durability):
        run_agent()
        durability.assert_clean()

The processor reports in ``silent`` mode: nothing is raised from ``span.end()``, so the
code under test runs exactly as in production; the plugin fails the test afterwards.
"""

from __future__ import annotations

import dataclasses
import threading
import weakref
from collections.abc import Iterator
from typing import Any

import pytest
from opentelemetry import trace as trace_api
from opentelemetry.sdk.trace import TracerProvider

from durable_sessions.processor import DurabilitySpanProcessor, format_violation
from durable_sessions.violation import Severity, Violation

_MODES = ("off", "report", "strict")


class _Counting(DurabilitySpanProcessor):
    """A test's processor, which counts the spans that reached it (however attached)."""

    def __init__(self, **options: Any) -> None:
        super().__init__(**options)
        self.spans_ended = 0

    def on_end(self, span) -> None:  # type: ignore[no-untyped-def]
        self.spans_ended += 1
        super().on_end(span)


class Durability:
    """The violations of the spans ended while a test runs."""

    def __init__(self, *, enabled: bool = True) -> None:
        self.violations: list[Violation] = []
        self._lock = threading.Lock()
        # inline whatever the environment says: a test's findings must be in by its end
        self.processor = _Counting(
            mode="silent" if enabled else "off",
            checking="inline",
            on_violation=self._collect,
            max_sessions=10_000,
        )
        self._provider_unset = False
        """No global SDK provider was set when the test started: attached at finish instead."""
        self.unchecked = False
        """The global provider was set during the test, and none of its spans reached the
        processor: they ended before anything was attached, unchecked."""

    def _attach_global(self) -> None:
        """Attach to the global SDK provider (once per provider); when there is none yet,
        try again at :meth:`finish`."""
        self._provider_unset = not _router.attach_global()

    def _attach_late(self) -> None:
        """The provider the test (or a fixture set up after this one) made global: attached
        now, for what ends from here on; what ended before was not seen."""
        if self._provider_unset and _router.attach_global():
            self._provider_unset = False
            self.unchecked = self.processor.spans_ended == 0

    def _collect(self, violation: Violation) -> None:
        with self._lock:
            self.violations.append(violation)

    @property
    def errors(self) -> list[Violation]:
        return [v for v in self.violations if v.severity == Severity.ERROR]

    def rules(self) -> set[str]:
        """The ids of the rules broken so far."""
        return {v.rule for v in self.violations}

    def finish(self) -> list[Violation]:
        """End every open session now (running end-of-session rules); return all violations.

        A global provider set during the test is attached here: see :attr:`unchecked`."""
        self._attach_late()
        self.processor.end_sessions()
        return list(self.violations)

    def clear(self) -> None:
        with self._lock:
            self.violations.clear()

    def assert_clean(self) -> None:
        """Fail the test when any span ended so far broke a rule (sessions are ended first),
        or when its spans could not be checked (:attr:`unchecked`)."""
        violations = self.finish()
        if violations:
            pytest.fail(_describe(violations), pytrace=False)
        if self.unchecked:  # a check that saw nothing is no clean bill
            pytest.fail(_UNCHECKED, pytrace=False)


class _Router:
    """One processor per provider, forwarding to whichever test's collector is active."""

    def __init__(self) -> None:
        self.active: Durability | None = None
        self._attached: weakref.WeakSet[TracerProvider] = weakref.WeakSet()

    def attach_global(self) -> bool:
        """Attach to the global SDK provider, once; False when none is set (yet)."""
        provider = trace_api.get_tracer_provider()
        if not isinstance(provider, TracerProvider):
            return False
        if provider not in self._attached:
            provider.add_span_processor(_Forwarding(self))
            self._attached.add(provider)
        return True


class _Forwarding(DurabilitySpanProcessor):
    """Attached once to the global provider; feeds the active test's processor."""

    def __init__(self, router: _Router) -> None:
        super().__init__(mode="off", copy_session=False)
        self._router = router

    def on_start(self, span, parent_context=None) -> None:  # type: ignore[no-untyped-def]
        active = self._router.active
        if active is not None:
            active.processor.on_start(span, parent_context)

    def on_end(self, span) -> None:  # type: ignore[no-untyped-def]
        active = self._router.active
        if active is not None:
            active.processor.on_end(span)


_router = _Router()


def _describe(violations: list[Violation]) -> str:
    lines = "\n".join(f"  {format_violation(v)}" for v in violations)
    return f"spans ended in this test broke {len(violations)} durability rule(s):\n{lines}"


_UNCHECKED = (  # what a test whose global provider came too late is told
    "the global TracerProvider was set during this test, after its durability check was set up, and none of "
    "the spans the test ended reached the check: set the provider before the test (a conftest, or a fixture "
    "the test lists before durability), or add durability.processor to it"
)


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("durability", "durable-sessions checks of the spans tests end")
    group.addoption(
        "--durability",
        choices=_MODES,
        default=None,
        help="report (default): the durability fixture collects violations; "
        "strict: fail every test whose spans break a rule; off: disable",
    )
    parser.addini("durability", "default for --durability (off, report, strict)", default="report")


def pytest_configure(config: pytest.Config) -> None:
    # A bad ini value is refused once, at start-up, as a bad --durability is; found at
    # each test's setup it errored every test that used the fixture, with a traceback.
    _mode(config)


def _mode(config: pytest.Config) -> str:
    mode = config.getoption("--durability") or config.getini("durability") or "report"
    if mode not in _MODES:
        raise pytest.UsageError(f"durability = {mode!r}; expected one of {', '.join(_MODES)}")
    return mode


@pytest.fixture
def durability(request: pytest.FixtureRequest) -> Iterator[Durability]:
    """Collects the durability violations of the spans ended during the test."""
    strict = request.node.stash.get(_STRICT, None)
    if strict is not None:  # strict mode collects from the start of the set-up: the same collector
        yield strict.collector
        return
    if _mode(request.config) == "off":  # checks nothing: assert_clean() always passes
        collector = Durability(enabled=False)
        yield collector
        collector.processor.shutdown()
        return
    collector = Durability()
    previous = _router.active
    _router.active = collector
    collector._attach_global()
    try:
        yield collector
    finally:
        _router.active = previous
        collector.processor.shutdown()


@dataclasses.dataclass
class _Strict:
    """A test's collector in strict mode, active from its set-up to the end of its call."""

    collector: Durability
    previous: Durability | None
    """The collector active before, restored when this one stops."""
    active: bool = True

    def stop(self) -> None:
        if self.active:
            self.active = False
            _router.active = self.previous


_STRICT = pytest.StashKey[_Strict]()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_setup(item: pytest.Item) -> Iterator[None]:
    # From the start of the set-up: a fixture that runs the agent (the test asserting on
    # what it returned) ends the test's spans before the test function runs.
    if _mode(item.config) == "strict":
        collector = Durability()
        item.stash[_STRICT] = _Strict(collector, _router.active)
        _router.active = collector
        collector._attach_global()
    yield


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Iterator[None]:
    strict = item.stash.get(_STRICT, None)
    if strict is None:
        yield
        return
    collector = strict.collector
    if collector._provider_unset:  # set by a fixture, after the collector started: what the test ends counts
        collector._attach_global()
    try:
        outcome = yield
    finally:
        strict.stop()
    violations = collector.finish()
    if violations and outcome.excinfo is None:
        outcome.force_exception(pytest.fail.Exception(_describe(violations), pytrace=False))
    elif collector.unchecked:
        # A warning, not a failure: a test that set the provider may have ended no span at all.
        item.warn(pytest.PytestWarning(f"durability: {_UNCHECKED}"))


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item: pytest.Item) -> Iterator[None]:
    yield
    strict = item.stash.get(_STRICT, None)
    if strict is not None:  # after the fixtures' own tear-down; a failed set-up never reached the call
        del item.stash[_STRICT]
        strict.stop()
        strict.collector.processor.shutdown()  # what it holds (an intent log it opened)


__all__ = ["Durability", "durability"]
