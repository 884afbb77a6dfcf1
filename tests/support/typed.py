"""Values compared with their types: what a C path and its Python reference must agree on."""

from __future__ import annotations

import math
from typing import Any


def typed(value: Any) -> Any:
    """``value`` with every type spelled out: True is not 1, -0.0 is not 0.0, NaN is NaN."""
    if isinstance(value, tuple | list):
        return (type(value).__name__, [typed(item) for item in value])
    if isinstance(value, dict):
        return ("dict", [(typed(key), typed(item)) for key, item in value.items()])
    if isinstance(value, float):
        return ("float", "nan" if math.isnan(value) else repr(value))
    return (type(value).__name__, value)
