"""The calls that ask a replica about itself or time it: its identity and counters, and the
calibration microbenchmarks a hardware profile is fitted to (`aaflow.cluster.calibration`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from aaflow.runtime.calls import CallKind, NoPromptCall


@dataclass(frozen=True)
class InfoCall(NoPromptCall):
    """Name, model, engine, fingerprint, dtype, threads, node, bytes per KV token, limits."""

    kind = CallKind.INFO
    Reply = dict


@dataclass(frozen=True)
class StatsCall(NoPromptCall):
    """used_blocks, tokens_computed, tokens_reused, refs (and what else the engine counts)."""

    kind = CallKind.STATS
    Reply = dict


@dataclass(frozen=True)
class SessionCountCall(NoPromptCall):
    """Sessions open now (calibration times a call's round trip with it)."""

    kind = CallKind.SESSION_COUNT
    Reply = int


@dataclass(frozen=True)
class MemcpyBandwidthCall(NoPromptCall):
    """In-process copy bandwidth in the replica (bytes/s): the bound for any transfer into it."""

    kind = CallKind.MEMCPY
    Reply = float


@dataclass(frozen=True)
class ClearPrefixCacheCall(NoPromptCall):
    """Forget every cached prefix block not in use (benchmarks start cold with it)."""

    kind = CallKind.CLEAR_PREFIX_CACHE
    Reply = None


@dataclass(frozen=True)
class CalibratePrefillCall(NoPromptCall):
    """(new tokens, context tokens, seconds) per point of `points` (None: the quick set)."""

    kind = CallKind.CALIBRATE_PREFILL
    Reply = list[tuple[int, int, float]]
    points: Any = None
    repeats: int = 1


@dataclass(frozen=True)
class CalibrateDecodeCall(NoPromptCall):
    """(batch, context tokens, seconds per step) per point of `points` (None: the quick set)."""

    kind = CallKind.CALIBRATE_DECODE
    Reply = list[tuple[int, int, float]]
    points: Any = None
    steps: int = 12


@dataclass(frozen=True)
class CalibratePackingCall(NoPromptCall):
    """(members, new tokens each, context tokens each, seconds) of packed prefills."""

    kind = CallKind.CALIBRATE_PACKING
    Reply = list[tuple[int, int, int, float]]


@dataclass(frozen=True)
class CalibrateReceiveCall(NoPromptCall):
    """Time a whole receive of what a peer exposed and drop what arrived: (bytes, seconds)."""

    kind = CallKind.CALIBRATE_RECEIVE
    Reply = tuple[int, float]
    handle: Any
    shape: Any
    record: Any
    transport: str
