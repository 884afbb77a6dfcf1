"""The pytest plugin, run in pytester subprocesses (each sets its own global TracerProvider)."""

from __future__ import annotations

import os

import pytest

pytest_plugins = ["pytester"]

CONFTEST = """
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider

trace.set_tracer_provider(TracerProvider())
"""

TESTS = """
from opentelemetry import trace
from durable_sessions.instrument import action, idempotency_key, session


def test_clean():
    with session("s-1"):
        with action("a1", "llm_call") as act:
            act.record("hello")
        with action("a2", "payment", idempotency_key=idempotency_key("s-1", "a2")) as act:
            act.record({"charge": "ch_1"})


def test_double_charge():
    with session("s-1"):
        with action("a7", "payment"):
            pass


def test_no_spans():
    assert True
"""


def test_fixture_collects_violations_of_the_global_provider(pytester: pytest.Pytester) -> None:
    pytester.makeconftest(CONFTEST)
    pytester.makepyfile(
        """
        from durable_sessions.instrument import action, session

        def test_collects(durability):
            with session("s-1"):
                with action("a7", "payment"):
                    pass
            assert durability.rules() == {"unkeyed-side-effect"}
            assert durability.errors[0].action_id == "a7"

        def test_next_test_starts_empty(durability):
            assert durability.violations == []

        def test_end_of_session_rules_run_at_finish(durability):
            with session("s-2"):
                with action("a1", "email", status="started"):
                    pass
            assert durability.violations == []
            assert [v.rule for v in durability.finish()] == ["unresolved-side-effect"]

        def test_assert_clean_fails(durability):
            with session("s-3"):
                with action("a1", "llm_call"):
                    pass
            durability.assert_clean()
        """
    )
    result = pytester.runpytest_subprocess("-p", "durable_sessions.pytest_plugin")
    result.assert_outcomes(passed=3, failed=1)
    result.stdout.fnmatch_lines(["*broke 1 durability rule(s)*", "*[[]unrecorded-result[]]*"])


def test_strict_fails_tests_whose_spans_break_rules(pytester: pytest.Pytester) -> None:
    pytester.makeconftest(CONFTEST)
    pytester.makepyfile(TESTS)
    result = pytester.runpytest_subprocess("--durability=strict")
    result.assert_outcomes(passed=2, failed=1)
    result.stdout.fnmatch_lines(
        ["*test_double_charge*", "*[[]unkeyed-side-effect[]] error session 's-1' action 'a7'*"]
    )


def test_report_mode_fails_nothing(pytester: pytest.Pytester) -> None:
    pytester.makeconftest(CONFTEST)
    pytester.makepyfile(TESTS)
    pytester.runpytest_subprocess().assert_outcomes(passed=3)
    pytester.runpytest_subprocess("--durability=off").assert_outcomes(passed=3)


def test_ini_option(pytester: pytest.Pytester) -> None:
    pytester.makeconftest(CONFTEST)
    pytester.makeini("[pytest]\ndurability = strict\n")
    pytester.makepyfile(TESTS)
    pytester.runpytest_subprocess().assert_outcomes(passed=2, failed=1)


def test_a_bad_ini_value_stops_the_run_at_start_up(pytester: pytest.Pytester) -> None:
    """It was found at each test's setup: every test using the fixture errored with a
    traceback, and the others failed in the strict hook."""
    pytester.makeconftest(CONFTEST)
    pytester.makeini("[pytest]\ndurability = bogus\n")
    pytester.makepyfile(TESTS)
    result = pytester.runpytest_subprocess()
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*durability = 'bogus'; expected one of off, report, strict*"])
    assert "Traceback" not in result.stdout.str() + result.stderr.str()


def test_processor_can_be_added_to_a_test_provider(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        """
        from opentelemetry.sdk.trace import TracerProvider
        from durable_sessions.instrument import action, session

        def test_own_provider(durability):
            provider = TracerProvider()
            provider.add_span_processor(durability.processor)
            with session("s-1"):
                with action("a1", "deploy", tracer_provider=provider):
                    pass
            assert durability.rules() == {"unkeyed-side-effect"}
        """
    )
    pytester.runpytest_subprocess().assert_outcomes(passed=1)


def test_strict_does_not_mask_the_tests_own_failure(pytester: pytest.Pytester) -> None:
    pytester.makeconftest(CONFTEST)
    pytester.makepyfile(
        """
        from durable_sessions.instrument import action, session

        def test_fails_itself():
            with session("s-1"):
                with action("a7", "payment"):
                    pass
            assert 1 == 2, "own failure"
        """
    )
    result = pytester.runpytest_subprocess("--durability=strict")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*own failure*"])


def test_off_checks_nothing_even_for_tests_that_use_the_fixture(pytester: pytest.Pytester) -> None:
    # docs/processor.md: "`off` disables it": a test asking for a clean run passes, and
    # the fixture has seen no span.
    pytester.makeconftest(CONFTEST)
    pytester.makepyfile(
        """
        from durable_sessions.instrument import action, session

        def test_assert_clean_with_a_broken_rule(durability):
            with session("s-off"):
                with action("a1", "llm_call"):
                    pass
            durability.assert_clean()
            assert durability.violations == []
        """
    )
    pytester.runpytest_subprocess("--durability=report").assert_outcomes(failed=1)
    pytester.runpytest_subprocess("--durability=off").assert_outcomes(passed=1)


LATE_PROVIDER_TESTS = """
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from durable_sessions.instrument import action, session


def test_sets_the_provider_itself(durability):
    trace.set_tracer_provider(TracerProvider())
    with session("s-1"):
        with action("p1", "payment") as act:  # unkeyed: breaks a rule nobody saw
            act.record({"ok": 1})
    durability.assert_clean()


def test_the_next_test_is_checked(durability):
    with session("s-2"):
        with action("p1", "payment") as act:
            act.record({"ok": 1})
    assert durability.rules() == {"unkeyed-side-effect"}
"""


def test_a_provider_set_after_the_fixture_is_no_clean_bill(pytester: pytest.Pytester) -> None:
    """A review: the fixture attached only at its setup, so a test that set the global
    provider itself passed assert_clean() with an unkeyed payment."""
    pytester.makepyfile(LATE_PROVIDER_TESTS)
    result = pytester.runpytest_subprocess("-p", "durable_sessions.pytest_plugin")
    result.assert_outcomes(passed=1, failed=1)
    result.stdout.fnmatch_lines(
        ["*_ test_sets_the_provider_itself _*", "the global TracerProvider was set during this test*"]
    )


def test_a_provider_set_late_and_given_the_processor_is_checked(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        """
        from opentelemetry import trace
        from opentelemetry.sdk.trace import TracerProvider
        from durable_sessions.instrument import action, session

        def test_sets_the_provider_and_adds_the_processor(durability):
            provider = TracerProvider()
            provider.add_span_processor(durability.processor)
            trace.set_tracer_provider(provider)
            with session("s-1"):
                with action("a1", "llm_call") as act:
                    act.record("hi")
            durability.assert_clean()
            assert not durability.unchecked
        """
    )
    pytester.runpytest_subprocess("-p", "durable_sessions.pytest_plugin").assert_outcomes(passed=1)


def test_strict_warns_of_a_provider_set_late_and_checks_the_tests_after_it(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        """
        from opentelemetry import trace
        from opentelemetry.sdk.trace import TracerProvider
        from durable_sessions.instrument import action, session

        def test_sets_the_provider():
            trace.set_tracer_provider(TracerProvider())

        def test_double_charge():
            with session("s-1"):
                with action("a7", "payment"):
                    pass
        """
    )
    result = pytester.runpytest_subprocess("--durability=strict")
    result.assert_outcomes(passed=1, failed=1, warnings=1)
    result.stdout.fnmatch_lines(
        ["*durability: the global TracerProvider was set during this test*", "*FAILED*test_double_charge*"]
    )


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="lists descriptors through /proc")
def test_strict_lets_go_of_each_tests_processor(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A test without the fixture gets a processor of its own in strict mode; it was never
    shut down, so what it holds (here the intent log the environment names, a descriptor per
    test) stayed open for the rest of the run."""
    intents = pytester.path / "intents.jsonl"
    monkeypatch.setenv("DURABLE_SESSIONS_INTENT_LOG", str(intents))
    pytester.makeconftest(CONFTEST)
    pytester.makepyfile(
        f"""
        import os
        import pytest

        @pytest.mark.parametrize("n", range(5))
        def test_many(n):
            pass

        def test_open_descriptors_last():
            names = []
            for fd in os.listdir("/proc/self/fd"):
                try:
                    names.append(os.readlink(f"/proc/self/fd/{{fd}}"))
                except OSError:
                    pass
            assert names.count({str(intents)!r}) <= 1  # this test's own processor
        """
    )
    pytester.runpytest_subprocess("--durability=strict").assert_outcomes(passed=6)


def test_strict_checks_the_spans_the_tests_fixtures_end(pytester: pytest.Pytester) -> None:
    """A test whose agent runs in a fixture (the test asserts on what it returned): strict
    mode collected only while the test function ran, so the fixture's unkeyed payment
    passed unchecked, and so did one ended by a fixture set up before ``durability``."""
    pytester.makeconftest(CONFTEST)
    pytester.makepyfile(
        """
        import pytest
        from durable_sessions.instrument import action, session

        @pytest.fixture
        def booked():
            with session("s-1"):
                with action("a7", "payment"):
                    pass
            return "booked"

        def test_agent_in_a_fixture(booked):
            assert booked == "booked"

        def test_agent_in_a_fixture_before_durability(booked, durability):
            assert durability.rules() == {"unkeyed-side-effect"}

        def test_clean_after_them():
            pass
        """
    )
    result = pytester.runpytest_subprocess("--durability=strict")
    result.assert_outcomes(passed=1, failed=2)
    result.stdout.fnmatch_lines(
        [
            "*test_agent_in_a_fixture*",
            "*[[]unkeyed-side-effect[]] error session 's-1' action 'a7'*",
            "*test_agent_in_a_fixture_before_durability*",
            "*[[]unkeyed-side-effect[]] error session 's-1' action 'a7'*",
        ]
    )


def test_strict_lets_go_of_a_tests_processor_when_a_fixture_fails(pytester: pytest.Pytester) -> None:
    """The collector strict mode starts at a test's set-up stops collecting when the set-up
    fails (the test never runs): the next test sees only its own spans."""
    pytester.makeconftest(CONFTEST)
    pytester.makepyfile(
        """
        import pytest
        from durable_sessions.instrument import action, session

        @pytest.fixture
        def broken():
            raise RuntimeError("no database")

        def test_errors(broken):
            pass

        def test_next(durability):
            with session("s-2"):
                with action("a1", "llm_call") as act:
                    act.record("fine")
            assert durability.violations == []
        """
    )
    pytester.runpytest_subprocess("--durability=strict").assert_outcomes(passed=1, errors=1)


def test_strict_checks_a_test_whose_fixture_sets_the_global_provider(pytester: pytest.Pytester) -> None:
    """Strict mode's collector starts before the fixtures: one that sets the global
    provider sets it after, and the collector attaches to it when the test function starts."""
    pytester.makepyfile(
        """
        import pytest
        from opentelemetry import trace
        from opentelemetry.sdk.trace import TracerProvider
        from durable_sessions.instrument import action, session

        @pytest.fixture
        def tracing():
            trace.set_tracer_provider(TracerProvider())

        def test_double_charge(tracing):
            with session("s-1"):
                with action("a7", "payment"):
                    pass
        """
    )
    result = pytester.runpytest_subprocess("--durability=strict")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*[[]unkeyed-side-effect[]] error session 's-1' action 'a7'*"])
