"""Strict JSON out: every JSON text moeswap writes (reports, configs, headers, worker replies) goes
through `dumps` / `dump`, which refuse NaN and Infinity so that any strict parser reads the result.

A value that is undefined (a rate over zero tokens, a precision with nothing predicted) is None at its
source and is written as null; a non-finite float that reaches this module is a bug and raises,
naming where it sits in the object.
"""

from __future__ import annotations

import json
import math
from typing import IO, Any


def dumps(obj: Any, **kwargs) -> str:
    """json.dumps with allow_nan=False; a non-finite float raises ValueError with its path, e.g. `$.rows[2].x`."""
    try:
        return json.dumps(obj, allow_nan=False, **kwargs)
    except ValueError:
        where = _non_finite(obj, "$")
        if where is None:  # out of reach of the walk (made by a `default=` hook): json's own message
            raise
        raise ValueError(f"not writing invalid JSON: {where[1]} at {where[0]} (an undefined value must be None)") \
            from None


def dump(obj: Any, fp: IO[str], **kwargs) -> None:
    fp.write(dumps(obj, **kwargs))


def _non_finite(obj: Any, path: str) -> tuple[str, float] | None:
    if isinstance(obj, float):
        return None if math.isfinite(obj) else (path, obj)
    if isinstance(obj, dict):
        items = ((f"{path}.{k}", v) for k, v in obj.items())
    elif isinstance(obj, (list, tuple)):
        items = ((f"{path}[{i}]", v) for i, v in enumerate(obj))
    else:
        return None
    return next((hit for p, v in items if (hit := _non_finite(v, p)) is not None), None)
