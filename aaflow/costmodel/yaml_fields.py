"""Reading profile YAML into dataclasses: unknown or missing keys and non-numbers are refused
with an error naming them; durations and bandwidths may carry units ("10us", "25Gbps")."""

from __future__ import annotations

from dataclasses import MISSING, fields

from aaflow.common.errors import CostModelError
from aaflow.costmodel.units import parse_bandwidth, parse_duration


def checked_keys(d, cls, where: str) -> dict:
    """`d` checked against the dataclass `cls`: a mapping, no unknown keys, all required keys."""
    if not isinstance(d, dict):
        raise CostModelError(f"{where}: expected a mapping, got {type(d).__name__}")
    known = {f.name: f for f in fields(cls)}
    unknown = sorted(set(d) - set(known))
    if unknown:
        raise CostModelError(f"{where}: unknown key(s) {unknown}; known keys: {sorted(known)}")
    required = [n for n, f in known.items() if f.default is MISSING and f.default_factory is MISSING]
    missing = [n for n in required if n not in d]
    if missing:
        raise CostModelError(f"{where}: missing key(s) {missing}")
    return d


def numbers(d: dict, where: str) -> dict:
    """Numeric values as floats; strings with units are accepted for *_bytes_per_s and *_s keys."""
    out = {}
    for key, value in d.items():
        if value is None:
            out[key] = None
        elif isinstance(value, bool):
            raise CostModelError(f"{where}: {key} must be a number, got {value!r}")
        elif key.endswith("_bytes_per_s"):
            out[key] = parse_bandwidth(value)
        elif key.endswith("_s"):
            out[key] = parse_duration(value)
        else:
            try:
                out[key] = float(value)
            except (TypeError, ValueError):
                raise CostModelError(f"{where}: {key} must be a number, got {value!r}") from None
    return out
