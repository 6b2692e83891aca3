"""JSON the tools print (``--json``): NaN and infinities, which Python's ``json`` writes as the
non-standard ``NaN`` / ``Infinity`` and strict parsers refuse, become ``null`` (a Kendall tau of
constant lengths, a class with no requests, an unbounded rate)."""

from __future__ import annotations

import json
import math
from typing import Any


def finite(value: Any) -> Any:
    """``value`` with every non-finite float (numpy's too) replaced by None, recursively."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite(v) for v in value]
    return value


def dumps(value: Any, **kwargs: Any) -> str:
    return json.dumps(finite(value), allow_nan=False, **kwargs)
