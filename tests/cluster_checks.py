"""Workflows and assertions shared by the tests that run workflows on a live cluster."""

from __future__ import annotations


def assert_no_kv_left(cluster) -> None:
    """Every replica is back to empty: no open session, no KVRef, no used block."""
    import ray

    for r in cluster.replicas():
        stats = ray.get(r.actor.stats.remote())
        assert ray.get(r.actor.session_count.remote()) == 0, f"{r.name} still has sessions"
        assert stats["refs"] == 0 and stats["used_blocks"] == 0, f"{r.name} holds KV after the run: {stats}"


DOC = "Shared context: KV caches keep keys and values. " * 8  # ~400 byte tokens: prefix sharing kicks in


def fixed_length_chain(model: str):
    """plan -> draft -> edit on one shared context, each generating a fixed number of tokens."""
    import aaflow as af

    wf = af.Workflow("chain")
    guide = wf.context("guide", DOC)
    a = wf.agent("plan", model, [guide, "Plan."], max_tokens=10, ignore_eos=True)
    b = wf.agent("draft", model, [guide, a, "Draft."], max_tokens=10, ignore_eos=True)
    wf.agent("edit", model, [guide, b, "Edit."], max_tokens=8, ignore_eos=True)
    return wf
