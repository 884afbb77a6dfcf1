"""The ``DURABLE_SESSIONS_*`` environment variables some part of the project reads, and
those in an environment that none reads: a misspelt one (``…_IDEL_S``, meant as ``DURABLE_SESSIONS_IDLE_S``)
was ignored without a word, and the sidecar ran on the default.

The known set is gathered from where each part declares its variables, not written out
again here: the sidecar's settings (:data:`~durable_sessions_collector.config.OPTIONS`),
the ``sessions`` client's, the span processor's documented table, the library's other
modules (the crash harness, the result store, the C extensions' switch, the checker
process's mark) and the test suite's, which are declared here since the tests are not
installed and a sidecar the suite starts inherits them.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping

from durable_sessions_collector.client import CLIENT_VARIABLES
from durable_sessions_collector.config import CONFIG_ENV, ENV_PREFIX, OPTIONS, closest

TEST_POSTGRES_DSN = "DURABLE_SESSIONS_TEST_POSTGRES_DSN"
"""The PostgreSQL server the test suite's PostgreSQL tests use (they skip without it)."""
REQUIRE_POSTGRES = "DURABLE_SESSIONS_REQUIRE_POSTGRES"
"""``1``: the test suite fails, rather than skips, without that server (CI sets it)."""
REQUIRE_NATIVE = "DURABLE_SESSIONS_REQUIRE_NATIVE"
"""``1``: the test suite fails, rather than skips, where a C extension was not built (CI)."""
TEST_SUITE_VARIABLES = (TEST_POSTGRES_DSN, REQUIRE_POSTGRES, REQUIRE_NATIVE)

NOT_READ = "no part of durable-sessions reads it"
"""What a warning says of a variable :func:`unknown_variables` names."""

_DOCUMENTED = re.compile(rf"^``({ENV_PREFIX}[A-Z0-9_]+)``", re.MULTILINE)


def known_variables() -> frozenset[str]:
    """Every ``DURABLE_SESSIONS_*`` variable some part of the project reads."""
    # Imported here, only when a variable is not this distribution's: the processor brings
    # the OpenTelemetry SDK along.
    from durable_sessions import crash, harness, instrument, native, offload, processor

    library = {
        crash.ENV,
        crash.COUNT_ENV,
        harness.JOURNAL_ENV,
        harness.TRACES_ENV,
        harness.DIR_ENV,
        instrument.RESULT_DIR_ENV,
        native.SWITCH,
        offload.IN_CHECKER_ENV,
        *_DOCUMENTED.findall(processor.__doc__ or ""),
    }
    return frozenset(library | _sidecar_variables())


def _sidecar_variables() -> frozenset[str]:
    """The variables of this distribution: the sidecar's, the client's, the tests'."""
    return frozenset(
        {CONFIG_ENV, *(option.env for option in OPTIONS), *CLIENT_VARIABLES, *TEST_SUITE_VARIABLES}
    )


def unknown_variables(environ: Mapping[str, str]) -> Iterator[tuple[str, str | None]]:
    """(name, the known variable it is closest to, or None) of each variable of
    ``environ`` named ``DURABLE_SESSIONS_*`` (in any case: the environment's names are
    case-sensitive, so ``durable_sessions_idle_s`` is not read either) that no part of the
    project reads. Only names: a value may be a secret."""
    sidecar = _sidecar_variables()
    if all(name in sidecar for name in environ if name.upper().startswith(ENV_PREFIX)):
        return  # the common case, without importing the library's modules
    known = known_variables()
    # A setting's whole key as a variable (…_EVALUATION_IDLE_S, as other tools name theirs)
    # is too far from its variable's name for a spelling match.
    by_key = {ENV_PREFIX + option.key.upper().replace(".", "_"): option.env for option in OPTIONS}
    # Compared without the prefix they all share, which would make every name look close.
    suffixes = [variable.removeprefix(ENV_PREFIX) for variable in known]
    for name in sorted(environ):
        if name.upper().startswith(ENV_PREFIX) and name not in known:
            if name.upper() in by_key:
                yield name, by_key[name.upper()]
                continue
            close = closest(name.upper().removeprefix(ENV_PREFIX), suffixes)
            yield name, None if close is None else ENV_PREFIX + close
