"""The optional C extension, ``durable_sessions._native``, and the switch that turns it off.

``pip install`` builds the extension where a C compiler is available. It holds the
hottest per-item steps of the span processor (``on_start``, and ``on_end`` with
``checking="process"``) and of the parallel offline check (routing lines to workers),
each of which also exists in Python: the Python code stays the reference, is used
wherever the extension is missing or declines an item, and is what
``DURABLE_SESSIONS_NATIVE=false`` selects.
"""

from __future__ import annotations

import os
from types import ModuleType

SWITCH = "DURABLE_SESSIONS_NATIVE"


def native_module() -> ModuleType | None:
    """The extension module, or None when it was not built or ``DURABLE_SESSIONS_NATIVE``
    is ``false`` (or ``0``, ``no``, ``off``)."""
    if os.environ.get(SWITCH, "").strip().lower() in ("0", "false", "no", "off"):
        return None
    try:
        from durable_sessions import _native
    except ImportError:
        return None
    return _native
