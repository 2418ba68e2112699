"""How large a replica's KV pool is by default: a share of this machine's memory.

`AAFLOW_KV_CACHE_BYTES` (bytes, or with a unit: "1.5GiB", "800MB") sets it for every replica;
otherwise the replicas of one machine share `MEMORY_FRACTION` of its physical memory, each
between `MIN_BYTES` and `MAX_BYTES`. An explicit `kv_cache_bytes=` (or `--kv-cache-bytes`) wins.
"""

from __future__ import annotations

import os
import re

from aaflow.common.errors import AAFlowError

ENV_VAR = "AAFLOW_KV_CACHE_BYTES"
MEMORY_FRACTION = 0.10  # of physical memory, for all the replicas of one machine together
MIN_BYTES = 256 * 2**20
MAX_BYTES = 8 * 2**30
IN_PROCESS_BYTES = 256 * 2**20  # an `Engine` built in the caller's process (tests, `aaflow chat`)
_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "kib": 2**10, "mib": 2**20, "gib": 2**30}
_SIZE_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([a-z]*)\s*$", re.IGNORECASE)


class KVBudgetError(AAFlowError, ValueError):
    """A KV pool size that is not a positive number of bytes."""


def parse_bytes(value: str | int, what: str = "kv_cache_bytes") -> int:
    """Bytes from an int or a string such as "1.5GiB", "800MB", "268435456"."""
    if isinstance(value, int) and not isinstance(value, bool):
        number = value
    else:
        match = _SIZE_RE.match(str(value))
        unit = match.group(2).lower() if match else None
        if match is None or unit not in _UNITS:
            raise KVBudgetError(f"bad {what} {value!r}: give bytes, or a number with B, KB, MB, GB, KiB, MiB or GiB")
        number = int(float(match.group(1)) * _UNITS[unit])
    if number <= 0:
        raise KVBudgetError(f"bad {what} {value!r}: must be positive")
    return number


def physical_memory_bytes() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def in_process_kv_cache_bytes() -> int:
    """The pool of an engine built in the caller's process: `AAFLOW_KV_CACHE_BYTES`, else 256 MiB
    (a program may build several; replicas get their share of memory, `default_kv_cache_bytes`)."""
    if os.environ.get(ENV_VAR):
        return parse_bytes(os.environ[ENV_VAR], ENV_VAR)
    return IN_PROCESS_BYTES


def default_kv_cache_bytes(replicas_here: int = 1) -> int:
    """The pool of one of `replicas_here` replicas on this machine (see the module docstring)."""
    if os.environ.get(ENV_VAR):
        return parse_bytes(os.environ[ENV_VAR], ENV_VAR)
    share = int(physical_memory_bytes() * MEMORY_FRACTION) // max(1, replicas_here)
    return max(MIN_BYTES, min(MAX_BYTES, share))
