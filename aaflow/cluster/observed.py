"""Replicas that report what they hold and do: Ray metrics and `usage()` for `aaflow status`.

`observed(cls)` subclasses a `Replica` class so that every public call is timed (busy seconds),
releases pins whose TTL ran out before it starts (`KVHost.release_expired`), and afterwards
updates the replica's Ray metrics (`ray.util.metrics`, exported by each node's metrics agent in
Prometheus format and shown on the Ray dashboard), tagged with the replica and model:

    aaflow_kv_bytes_held          gauge    KV blocks in use (sequences, refs, sessions)
    aaflow_kv_bytes_pinned        gauge    refs pinned against eviction (TTL not yet expired)
    aaflow_kv_bytes_evictable     gauge    prefix-cached blocks and unpinned refs the pool may drop
    aaflow_kv_bytes_moved         counter  KV bytes received from other replicas
    aaflow_prefill_tokens_computed counter prompt tokens computed by a forward pass
    aaflow_prefill_tokens_reused  counter  prompt tokens served by the prefix cache
    aaflow_queue_depth            gauge    agent sessions open on the replica, from every client
    aaflow_busy_seconds           counter  seconds spent in calls

Gauges are computed at most every `REFRESH_S` seconds during calls (and on every `usage()`); a
daemon thread sets their last values again every `RESEND_S` seconds, because Ray exports a gauge
only in the report interval after it was set, and an idle replica still holds its KV. The thread
touches no engine state, only the values the actor's own thread computed.
"""

from __future__ import annotations

import functools
import threading
import time
from collections import deque

from ray.util.metrics import Counter, Gauge

from aaflow.runtime.calls import Call
from aaflow.runtime.replies import Received

REFRESH_S = 0.25
RESEND_S = 1.0
_QUIET = frozenset({"usage", "info", "stats", "call_log"})  # read-only calls: not counted as busy time
CALLS_LOGGED = 200_000  # the last calls `call_log` can answer for (a few MB)


def observed(cls: type) -> type:
    """A subclass of replica class `cls` whose public calls are timed and reported (same name); its
    instances own a `UsageMeter` (`meter`), and `usage()` reads it."""
    wrapped = {name: _timed(getattr(cls, name)) for name in dir(cls)
               if not name.startswith("_") and name not in _QUIET and callable(getattr(cls, name))}

    def __init__(self, *args, **kwargs) -> None:
        cls.__init__(self, *args, **kwargs)
        self.meter = UsageMeter(self)

    def usage(self) -> dict:
        """What this replica holds and did (`UsageMeter.usage`); refreshes its Ray metrics."""
        return self.meter.usage()

    def call_log(self, since: float = 0.0) -> list[tuple[str, float, float, int]]:
        """The calls this replica ran that started at or after `since` (`time.time()`), oldest
        first, as (method, start time.time(), seconds, prompt tokens computed): the replica's side
        of a call trace."""
        return [entry for entry in self.meter.log if entry[1] >= since]

    return type(cls.__name__, (cls,), {**wrapped, "__init__": __init__, "usage": usage, "call_log": call_log,
                                       "__module__": cls.__module__, "__doc__": cls.__doc__})


def _timed(method):
    @functools.wraps(method)
    def call(self, *args, **kwargs):
        meter = self.meter
        # a typed call (`run(call)`) is counted and logged as the method its kind names
        name = args[0].method if method.__name__ == "run" and args and isinstance(args[0], Call) else method.__name__
        if meter.in_call or name in _QUIET:  # a call made by another call (or by `usage`), or a read: not timed
            return method(self, *args, **kwargs)
        meter.in_call = True
        start, began, result = time.perf_counter(), time.time(), None
        try:
            meter.before_call()
            result = method(self, *args, **kwargs)
            return result
        finally:
            try:
                meter.after_call(name, began, time.perf_counter() - start, result)
            finally:
                meter.in_call = False

    return call


class _Metrics:
    """The replica's Ray metrics, created in the actor process on its first call."""

    def __init__(self, tags: dict[str, str]) -> None:
        keys = tuple(tags)
        self.tags = tags
        self.gauges = {name: Gauge(f"aaflow_{name}", description=doc, tag_keys=keys) for name, doc in (
            ("kv_bytes_held", "KV bytes in use on the replica"),
            ("kv_bytes_pinned", "KV bytes pinned against eviction"),
            ("kv_bytes_evictable", "KV bytes the pool may drop (prefix cache, unpinned refs)"),
            ("queue_depth", "agent sessions open on the replica"))}
        self.counters = {name: Counter(f"aaflow_{name}", description=doc, tag_keys=keys) for name, doc in (
            ("kv_bytes_moved", "KV bytes received from other replicas"),
            ("prefill_tokens_computed", "prompt tokens computed by a forward pass"),
            ("prefill_tokens_reused", "prompt tokens served by the prefix cache"),
            ("busy_seconds", "seconds the replica spent in calls"))}

    def set(self, values: dict[str, float]) -> None:
        """Set the gauges (and keep the values for `resend`)."""
        self.last = values
        for name, value in values.items():
            self.gauges[name].set(float(value), tags=self.tags)

    def start_resending(self) -> None:
        def resend() -> None:
            while True:
                time.sleep(RESEND_S)
                self.set(self.last)

        self.last: dict[str, float] = {}
        threading.Thread(target=resend, name="aaflow-metrics", daemon=True).start()

    def add(self, name: str, value: float) -> None:
        if value > 0:
            self.counters[name].inc(float(value), tags=self.tags)


class UsageMeter:
    """An observed replica's counters and Ray metrics (made on its first call, in the actor)."""

    def __init__(self, replica) -> None:
        self.replica = replica
        self.host = getattr(replica, "host", None)  # a built-in replica's KVHost (pins, evictable refs)
        self.in_call = False  # a timed call is running: calls it makes are not timed again
        self.busy_s, self.calls, self.moved, self.computed, self.reused, self.refreshed = 0.0, 0, 0, 0, 0, 0.0
        self.block_bytes: int | None = None  # read from `info()` on first use
        self.metrics: _Metrics | None = None
        self.log: deque[tuple[str, float, float, int]] = deque(maxlen=CALLS_LOGGED)  # see `call_log`
        self.computed_before = 0  # the engine's tokens computed when the running call began

    def _started(self) -> None:
        if self.block_bytes is not None:
            return
        info = self.replica.info()
        self.block_bytes = info.get("bytes_per_token", 0) * info.get("block_size", 16)
        try:
            self.metrics = _Metrics({"replica": self.replica.name, "model": str(self.replica.model)})
            self.metrics.start_resending()
        except Exception:  # noqa: BLE001 - outside a Ray worker there is nothing to export to
            self.metrics = None

    def before_call(self) -> None:
        """Release pins whose TTL ran out (`KVHost.release_expired`) before a call starts."""
        if self.host is not None:
            self.host.release_expired()
        self.computed_before = self._computed()

    def _computed(self) -> int:
        engine = getattr(self.replica, "engine", None)
        return engine.stats().tokens_computed if hasattr(engine, "stats") else 0

    def after_call(self, method: str, began: float, seconds: float, result) -> None:
        """Count a call that began at `began` (`time.time()`) and took `seconds` (and the bytes a
        `receive` moved)."""
        self._started()
        self.log.append((method, began, seconds, self._computed() - self.computed_before))
        self.busy_s += seconds
        self.calls += 1
        moved = result.stats.nbytes if isinstance(result, Received) else 0
        self.moved += moved
        if self.metrics is not None:
            self.metrics.add("busy_seconds", seconds)
            self.metrics.add("kv_bytes_moved", moved)
            if time.monotonic() - self.refreshed >= REFRESH_S:
                self.usage()

    def usage(self) -> dict:
        """What this replica holds and did: KV bytes held / pinned / evictable, sessions open
        (its queue depth), prefill tokens computed / reused, bytes received, busy seconds. Also
        refreshes its Ray metrics."""
        outer, self.in_call = self.in_call, True  # the replica calls it makes are not timed
        try:
            return self._usage()
        finally:
            self.in_call = outer

    def _usage(self) -> dict:
        self._started()
        replica, host, stats = self.replica, self.host, self.replica.stats()
        block_bytes = self.block_bytes
        out = {"name": replica.name, "model": str(replica.model),
               "kv_bytes_held": (stats.get("used_blocks") or 0) * block_bytes,
               "kv_bytes_pinned": host.pinned_bytes() if host is not None else 0,
               "kv_bytes_evictable": (stats.get("cached_blocks") or 0) * block_bytes
               + (host.evictable_bytes() if host is not None else 0),
               "queue_depth": replica.session_count(), "refs": stats.get("refs", 0),
               "prefill_tokens_computed": stats.get("tokens_computed", 0),
               "prefill_tokens_reused": stats.get("tokens_reused", 0),
               "kv_bytes_moved": self.moved, "busy_s": self.busy_s, "calls": self.calls}
        if self.metrics is not None:
            self.metrics.set({name: out[name] for name in self.metrics.gauges})
            self.metrics.add("prefill_tokens_computed", out["prefill_tokens_computed"] - self.computed)
            self.metrics.add("prefill_tokens_reused", out["prefill_tokens_reused"] - self.reused)
            self.computed, self.reused = out["prefill_tokens_computed"], out["prefill_tokens_reused"]
            self.refreshed = time.monotonic()
        return out
