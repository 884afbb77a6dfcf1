"""The pytest plugin, run in pytester subprocesses (each sets its own global TracerProvider)."""

from __future__ import annotations

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
