"""What the per-test leak check watches beyond in-process engines (`conftest.kv_leak_check`):

- Ray replicas this process made (clusters not shut down, `replica_actor`s): no used pool block,
  KV host ref or open session after a test (a dead replica is skipped: fault tests kill them);
- transport endpoints of this process: none created by the test is left open;
- threads: none the test started is still running (transport service threads included).

A leak is reported and then cleaned up (replicas closed, endpoints closed), so one leak does not
fail every later test.
"""

from __future__ import annotations

import threading

THREAD_GRACE_S = 2.0  # a thread the test stopped may take a moment to end


class LeakWatch:
    """Snapshot at the start of a test; `problems()` at its end."""

    def __init__(self, keeps_transports: bool = False) -> None:
        from aaflow.cluster.transports.base import open_transports

        self.keeps_transports = keeps_transports  # the test hands new endpoints to a longer-lived fixture
        self.threads = {t.ident for t in threading.enumerate()}
        self.transports = {id(t) for t in open_transports()}

    def problems(self) -> list[str]:
        return self._replicas() + self._transports() + self._threads()

    def _replicas(self) -> list[str]:
        import sys

        if "ray" not in sys.modules or not sys.modules["ray"].is_initialized():
            return []
        import ray

        from aaflow.cluster.cluster import live_replica_actors

        problems = []
        for actor in live_replica_actors():
            try:
                stats, sessions = ray.get([actor.stats.remote(), actor.session_count.remote()], timeout=60)
            except Exception:  # noqa: BLE001 - a replica a test killed holds nothing
                continue
            if stats["used_blocks"] or stats["refs"] or sessions:
                problems.append(f"replica {actor}: {stats['used_blocks']} used blocks, {stats['refs']} refs, "
                                f"{sessions} sessions after the test")
                ray.get(actor.close.remote(), timeout=60)
        return problems

    def _transports(self) -> list[str]:
        from aaflow.cluster.transports.base import open_transports

        if self.keeps_transports:
            return []
        leaked = [t for t in open_transports() if id(t) not in self.transports]
        for t in leaked:
            t.close()
        return [f"transport endpoint {t.name!r} created by the test was never closed" for t in leaked]

    def _threads(self) -> list[str]:
        new = [t for t in threading.enumerate() if t.ident not in self.threads and not self.keeps_transports]
        for t in new:
            t.join(timeout=THREAD_GRACE_S / max(1, len(new)))
        ours = [t for t in new if t.is_alive() and (not t.daemon or t.name in ("nixl-notif-poller", "ucx-service"))]
        return [f"thread {t.name!r} started by the test is still running" for t in ours]
