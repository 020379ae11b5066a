"""Values as JSON can hold them: numpy scalars and arrays as Python numbers and lists, inf and NaN as null."""
from __future__ import annotations

import math

import numpy as np


def json_safe(value):
    """`value` with every dict key a string and every number a Python one; non-finite floats become None."""
    if isinstance(value, dict):
        return {str(k): json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    if isinstance(value, np.ndarray):
        return json_safe(value.tolist())
    if isinstance(value, (float, np.floating)):
        return float(value) if math.isfinite(value) else None  # JSON has no inf/NaN
    if isinstance(value, np.bool_):
        return bool(value)
    if isinstance(value, np.integer):
        return int(value)
    return value
