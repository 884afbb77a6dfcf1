"""A pytest plugin: durability violations of the spans a test ends.

Enable it with ``pytest -p durable_sessions.pytest_plugin`` (it is also registered under
the ``pytest11`` entry point, so installing the package enables it). It provides

- the ``durability`` fixture: a :class:`Durability` that collects the violations of spans
  ended during the test. Its :attr:`~Durability.processor` is already added to the global
  SDK ``TracerProvider`` when there is one; add it to any other provider the test builds.
  At the end of the test every session is ended, so the end-of-session rules run per test.
- ``--durability=strict``: every test gets the collector, and a test whose spans break a
  rule fails, listing the violations. ``--durability=report`` (the default) only
  collects; ``--durability=off`` disables the plugin.

::

    def test_booking(durability):
        run_agent()
        durability.assert_clean()

The processor reports in ``silent`` mode: nothing is raised from ``span.end()``, so the
code under test runs exactly as in production; the plugin fails the test afterwards.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Iterator

import pytest
from opentelemetry import trace as trace_api
from opentelemetry.sdk.trace import TracerProvider

from durable_sessions.processor import DurabilitySpanProcessor, format_violation
from durable_sessions.violation import Severity, Violation

_MODES = ("off", "report", "strict")


class Durability:
    """The violations of the spans ended while a test runs."""

    def __init__(self, *, enabled: bool = True) -> None:
        self.violations: list[Violation] = []
        self._lock = threading.Lock()
        # inline whatever the environment says: a test's findings must be in by its end
        self.processor = DurabilitySpanProcessor(
            mode="silent" if enabled else "off",
            checking="inline",
            on_violation=self._collect,
            max_sessions=10_000,
        )

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
        """End every open session now (running end-of-session rules); return all violations."""
        self.processor.end_sessions()
        return list(self.violations)

    def clear(self) -> None:
        with self._lock:
            self.violations.clear()

    def assert_clean(self) -> None:
        """Fail the test when any span ended so far broke a rule (sessions are ended first)."""
        violations = self.finish()
        if violations:
            pytest.fail(_describe(violations), pytrace=False)


class _Router:
    """One processor per provider, forwarding to whichever test's collector is active."""

    def __init__(self) -> None:
        self.active: Durability | None = None
        self._attached: weakref.WeakSet[TracerProvider] = weakref.WeakSet()

    def attach_global(self, durability: Durability) -> None:
        provider = trace_api.get_tracer_provider()
        if not isinstance(provider, TracerProvider):
            return
        if provider not in self._attached:
            provider.add_span_processor(_Forwarding(self))
            self._attached.add(provider)


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
    if _mode(request.config) == "off":  # checks nothing: assert_clean() always passes
        collector = Durability(enabled=False)
        yield collector
        collector.processor.shutdown()
        return
    collector = Durability()
    previous = _router.active
    _router.active = collector
    _router.attach_global(collector)
    try:
        yield collector
    finally:
        _router.active = previous
        collector.processor.shutdown()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Iterator[None]:
    if _mode(item.config) != "strict":
        yield
        return
    collector = getattr(item, "funcargs", {}).get("durability")
    owned = collector is None
    if owned:
        collector = Durability()
        previous = _router.active
        _router.active = collector
        _router.attach_global(collector)
    try:
        outcome = yield
    finally:
        if owned:
            _router.active = previous
    violations = collector.finish()
    if violations and outcome.excinfo is None:
        outcome.force_exception(pytest.fail.Exception(_describe(violations), pytrace=False))


__all__ = ["Durability", "durability"]
