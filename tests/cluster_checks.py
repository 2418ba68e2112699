"""Assertions shared by the tests that run workflows on a live cluster."""

from __future__ import annotations


def assert_no_kv_left(cluster) -> None:
    """Every replica is back to empty: no open session, no KVRef, no used block."""
    import ray

    for r in cluster.replicas():
        stats = ray.get(r.actor.stats.remote())
        assert ray.get(r.actor.session_count.remote()) == 0, f"{r.name} still has sessions"
        assert stats["refs"] == 0 and stats["used_blocks"] == 0, f"{r.name} holds KV after the run: {stats}"
