"""The optional C extensions and the switch that turns them off.

``pip install`` builds them where a C compiler is available:

- ``durable_sessions._native`` holds the hottest per-item steps of the span processor
  (``on_start``, and ``on_end`` with ``checking="process"``) and of the parallel offline
  check (routing lines to workers), and the marking of the strings that are not UTF-8
  text in an OTLP/JSON body orjson refused (``bad_text.marked``, in the sidecar and
  ``check``);
- ``durable_sessions._engine`` dispatches every record to the rules that apply
  (``Checker.feed``), and ``durable_sessions._memory`` folds it into its session's
  memory (``SessionState.remember``), for the engine wherever it runs;
- ``durable_sessions._mapping`` maps a span's attributes to its action record
  (``mapping.map_attributes``) in every front end that maps spans: the span processor,
  the sidecar and the OTLP/JSON reader;
- the sidecar's ``durable_sessions_collector.otlp._wire`` reads binary OTLP trace
  requests into the parts the mapping takes, and its
  ``durable_sessions_collector.store._rows`` builds the stored row of each mapped record.

Each step also exists in Python: the Python code stays the reference, is used wherever
an extension is missing or declines an item, and is what ``DURABLE_SESSIONS_NATIVE=false``
selects.
"""

from __future__ import annotations

import functools
import importlib
import os
import warnings
from types import ModuleType

SWITCH = "DURABLE_SESSIONS_NATIVE"
OFF = frozenset({"0", "false", "no", "off"})
ON = frozenset({"", "1", "true", "yes", "on"})


def native_module(
    name: str = "_native", package: str = "durable_sessions", *, warn: bool = True
) -> ModuleType | None:
    """The extension module ``<package>.<name>``, or None when it was not built or
    ``DURABLE_SESSIONS_NATIVE`` is ``false`` (or ``0``, ``no``, ``off``).

    Any other value than those and ``true`` (``1``, ``yes``, ``on``) warns once and
    leaves the extensions on: a typo such as ``flase`` was silently read as on. It warns
    rather than raises, since this runs where the processor is imported, in user code.
    ``warn=False`` leaves the warning to the front end's own extension, for a module
    that chooses its C path as it is imported (the mapping, the sidecar's rows): the
    import would write it before a front end could say it its own way (``serve``
    writes JSON lines only), and whatever imported the module for nothing else.
    """
    value = os.environ.get(SWITCH, "").strip().lower()
    if value in OFF:
        return None
    if warn and value not in ON:
        _warn_unknown(value)
    try:
        return importlib.import_module(f"{package}.{name}")
    except ImportError:
        return None


UNKNOWN_SWITCH = "neither true nor false (1/0, yes/no, on/off): the C extensions stay on"


def unknown_switch() -> str | None:
    """The value of ``DURABLE_SESSIONS_NATIVE`` when it is neither on nor off, else None."""
    value = os.environ.get(SWITCH, "").strip().lower()
    return None if value in OFF or value in ON else value


@functools.cache
def _warn_unknown(value: str) -> None:
    warnings.warn(
        f"{SWITCH}={value!r} is {UNKNOWN_SWITCH}",
        RuntimeWarning,
        stacklevel=3,
    )


LIBRARY_EXTENSIONS = (
    ("durable_sessions", "_native"),
    ("durable_sessions", "_engine"),
    ("durable_sessions", "_memory"),
    ("durable_sessions", "_mapping"),
)


def extensions_note(extensions: tuple[tuple[str, str], ...] = LIBRARY_EXTENSIONS) -> str:
    """Which of ``extensions`` (package, module name) run, for ``--version``: a build
    without a compiler skips them with a warning pip shows only with ``-v``, and the
    Python code then gives the same results, slower, so nothing else tells a user."""
    if os.environ.get(SWITCH, "").strip().lower() in OFF:
        return f"C extensions off ({SWITCH}); the Python code runs"
    built = {f"{package}.{name}": native_module(name, package) is not None for package, name in extensions}
    missing = [name for name, found in built.items() if not found]
    if len(missing) == len(built):
        return "C extensions not built; the Python code runs"
    note = "C extensions: " + ", ".join(name for name, found in built.items() if found)
    return note + (f" (not built: {', '.join(missing)}; the Python code runs for them)" if missing else "")
