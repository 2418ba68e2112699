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
import time

REFRESH_S = 0.25
RESEND_S = 1.0
_QUIET = frozenset({"usage", "info", "stats"})  # read-only calls: not counted as busy time


def observed(cls: type) -> type:
    """A subclass of replica class `cls` whose public calls are timed and reported (same name)."""
    wrapped = {name: _timed(getattr(cls, name)) for name in dir(cls)
               if not name.startswith("_") and name not in _QUIET and callable(getattr(cls, name))}
    return type(cls.__name__, (cls, Observed), {**wrapped, "__module__": cls.__module__, "__doc__": cls.__doc__})


def _timed(method):
    @functools.wraps(method)
    def call(self, *args, **kwargs):
        if getattr(self, "_in_call", False):  # a call made by another call (or by `usage`): not timed again
            return method(self, *args, **kwargs)
        self._in_call = True
        start, result = time.perf_counter(), None
        try:
            self._before_call()
            result = method(self, *args, **kwargs)
            return result
        finally:
            try:
                self._after_call(method.__name__, time.perf_counter() - start, result)
            finally:
                self._in_call = False

    return call


class _Metrics:
    """The replica's Ray metrics, created in the actor process on its first call."""

    def __init__(self, tags: dict[str, str]) -> None:
        from ray.util.metrics import Counter, Gauge

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
        import threading

        def resend() -> None:
            while True:
                time.sleep(RESEND_S)
                self.set(self.last)

        self.last: dict[str, float] = {}
        threading.Thread(target=resend, name="aaflow-metrics", daemon=True).start()

    def add(self, name: str, value: float) -> None:
        if value > 0:
            self.counters[name].inc(float(value), tags=self.tags)


class Observed:
    """Mixin state of an observed replica (attributes are made lazily: no `__init__` to chain)."""

    def _before_call(self) -> None:
        host = getattr(self, "host", None)
        if host is not None:
            host.release_expired()

    def _observing(self) -> dict:
        """This replica's counters (made on first use, with its Ray metrics where Ray runs)."""
        if not hasattr(self, "_obs"):
            info = self.info()
            self._obs = {"busy_s": 0.0, "calls": 0, "moved": 0, "computed": 0, "reused": 0, "refreshed": 0.0,
                         "block_bytes": info.get("bytes_per_token", 0) * info.get("block_size", 16)}
            try:
                self._metrics = _Metrics({"replica": self.name, "model": str(self.model)})
                self._metrics.start_resending()
            except Exception:  # noqa: BLE001 - outside a Ray worker there is nothing to export to
                self._metrics = None
        return self._obs

    def _after_call(self, method: str, seconds: float, result) -> None:
        obs = self._observing()
        obs["busy_s"] += seconds
        obs["calls"] += 1
        moved = getattr(result[1], "nbytes", 0) if method == "receive" and isinstance(result, tuple) else 0
        obs["moved"] += moved
        if self._metrics is not None:
            self._metrics.add("busy_seconds", seconds)
            self._metrics.add("kv_bytes_moved", moved)
            if time.monotonic() - obs["refreshed"] >= REFRESH_S:
                self.usage()

    def usage(self) -> dict:
        """What this replica holds and did: KV bytes held / pinned / evictable, sessions open
        (its queue depth), prefill tokens computed / reused, bytes received, busy seconds. Also
        refreshes its Ray metrics."""
        outer, self._in_call = getattr(self, "_in_call", False), True  # its own calls are not timed
        try:
            return self._usage()
        finally:
            self._in_call = outer

    def _usage(self) -> dict:
        obs, stats = self._observing(), self.stats()
        host = getattr(self, "host", None)
        block_bytes = obs["block_bytes"]
        out = {"name": self.name, "model": str(self.model),
               "kv_bytes_held": (stats.get("used_blocks") or 0) * block_bytes,
               "kv_bytes_pinned": host.pinned_bytes() if host is not None else 0,
               "kv_bytes_evictable": (stats.get("cached_blocks") or 0) * block_bytes
               + (host.evictable_bytes() if host is not None else 0),
               "queue_depth": self.session_count(), "refs": stats.get("refs", 0),
               "prefill_tokens_computed": stats.get("tokens_computed", 0),
               "prefill_tokens_reused": stats.get("tokens_reused", 0),
               "kv_bytes_moved": obs["moved"], "busy_s": obs["busy_s"], "calls": obs["calls"]}
        if self._metrics is not None:
            self._metrics.set({name: out[name] for name in self._metrics.gauges})
            self._metrics.add("prefill_tokens_computed", out["prefill_tokens_computed"] - obs["computed"])
            self._metrics.add("prefill_tokens_reused", out["prefill_tokens_reused"] - obs["reused"])
            obs["computed"], obs["reused"] = out["prefill_tokens_computed"], out["prefill_tokens_reused"]
            obs["refreshed"] = time.monotonic()
        return out
