"""Units of the cost model: parse and format bandwidths (bytes/s) and durations (seconds).

Everything inside the cost model is in bytes, bytes/s and seconds. Strings with units only
appear at the edges (YAML profiles, the CLI, reports); this module converts them. In a
bandwidth string the case of b matters: `b` is bits, `B` is bytes ("25Gbps" is 3.125e9 B/s,
"3GB/s" is 3e9 B/s). Prefixes k/M/G/T are decimal; Ki/Mi/Gi/Ti are binary.
"""

from __future__ import annotations

import math
import re

from aaflow.common.errors import CostModelError

BANDWIDTH_FORMS = ('a number of bytes/s (3e9)', '"25Gbps"', '"25 Gb/s"', '"100 Mbps"', '"3GB/s"', '"3 GBps"',
                   '"500MB/s"', '"1.5 GiB/s"')
DURATION_FORMS = ('a number of seconds (0.2)', '"50us"', '"50µs"', '"1ms"', '"0.2s"', '"10ns"')

_NUMBER = r"([-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?)"
_BANDWIDTH_RE = re.compile(_NUMBER + r"\s*([kKmMgGtT]i?)?([bB])(?:/s|ps)$")
_DURATION_RE = re.compile(_NUMBER + r"\s*(ns|us|µs|μs|ms|s)$")
_DECIMAL = {"k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12}
_BINARY = {"k": 2.0**10, "m": 2.0**20, "g": 2.0**30, "t": 2.0**40}
_PER_SECOND = {"ns": 1e9, "us": 1e6, "µs": 1e6, "μs": 1e6, "ms": 1e3, "s": 1.0}  # divide: 10 / 1e6 is exact 1e-5


def gbps(x: float) -> float:
    """Gigabits per second -> bytes per second (x * 1e9 / 8)."""
    return x * 1e9 / 8


def _as_number(value, what: str, forms: tuple[str, ...]) -> float | None:
    """A bool-free int/float or a plain numeric string as float; None when it carries a unit."""
    if isinstance(value, bool):
        raise CostModelError(f"bad {what} {value!r}; accepted forms: {', '.join(forms)}")
    if isinstance(value, (int, float)):
        return float(value)
    if not isinstance(value, str):
        raise CostModelError(f"bad {what} {value!r} (type {type(value).__name__}); accepted forms: {', '.join(forms)}")
    try:
        return float(value.strip())
    except ValueError:
        return None


def parse_bandwidth(value: str | float) -> float:
    """A bandwidth in bytes/s from a number (already bytes/s) or a string with units.

    Raises:
        CostModelError: the value is not one of the accepted forms, or is not finite and positive.
    """
    number = _as_number(value, "bandwidth", BANDWIDTH_FORMS)
    if number is None:
        match = _BANDWIDTH_RE.match(value.strip())
        if match is None:
            raise CostModelError(f"bad bandwidth {value!r}; accepted forms: {', '.join(BANDWIDTH_FORMS)}")
        mantissa, prefix, bit_or_byte = match.groups()
        scale = 1.0
        if prefix:
            table = _BINARY if prefix.endswith("i") else _DECIMAL
            scale = table[prefix[0].lower()]
        number = float(mantissa) * scale / (8 if bit_or_byte == "b" else 1)
    if not math.isfinite(number) or number <= 0:
        raise CostModelError(f"bad bandwidth {value!r}: must be finite and positive (bytes/s)")
    return number


def parse_duration(value: str | float) -> float:
    """A duration in seconds from a number (already seconds) or a string with units.

    Raises:
        CostModelError: the value is not one of the accepted forms, or is negative or not finite.
    """
    number = _as_number(value, "duration", DURATION_FORMS)
    if number is None:
        match = _DURATION_RE.match(value.strip())
        if match is None:
            raise CostModelError(f"bad duration {value!r}; accepted forms: {', '.join(DURATION_FORMS)}")
        number = float(match.group(1)) / _PER_SECOND[match.group(2)]
    if not math.isfinite(number) or number < 0:
        raise CostModelError(f"bad duration {value!r}: must be finite and non-negative (seconds)")
    return number


def _three_digits(x: float) -> str:
    """x with three significant digits, trailing zeros kept (3.12, 25.0, 250)."""
    if x == 0:
        return "0"
    decimals = max(0, 2 - math.floor(math.log10(abs(x))))
    text = f"{x:.{decimals}f}"
    if len(text.lstrip("-").replace(".", "").lstrip("0")) > 3 and decimals:  # rounding carried (9.996 -> 10.00)
        text = f"{x:.{decimals - 1}f}"
    return text


def format_bandwidth(bytes_per_s: float) -> str:
    """A human-readable bandwidth in bytes and bits, e.g. "3.12 GB/s (25.0 Gbps)"."""
    def scaled(v: float, unit: str) -> str:
        for factor, prefix in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
            if abs(v) >= factor:
                return f"{_three_digits(v / factor)} {prefix}{unit}"
        return f"{_three_digits(v)} {unit}"

    return f"{scaled(bytes_per_s, 'B/s')} ({scaled(bytes_per_s * 8, 'bps')})"


def format_seconds(s: float) -> str:
    """A human-readable duration: "1.20 s", "12.3 ms", "45 µs"."""
    if s < 0:
        return "-" + format_seconds(-s)
    if s == 0:
        return "0 s"
    if s >= 1:
        return f"{_three_digits(s)} s"
    if s >= 1e-3:
        return f"{_three_digits(s * 1e3)} ms"
    if s >= 1e-6:
        return f"{s * 1e6:.0f} µs"
    return f"{_three_digits(s * 1e6)} µs"
