"""A shared prefix computed while agents decode on its replica: warmed in chunks that ride on their
decode steps (`aaflow.runtime.prefix_warmup`), then materialized from the prefix cache; a refused
chunk falls back to materializing it at once."""

from __future__ import annotations

import threading

import pytest
import ray

import aaflow as af
from aaflow.runtime.prefix_warmup import WARM_CHUNK_TOKENS
from aaflow.runtime.service import service_for
from tests.cluster_checks import assert_no_kv_left
from tests.test_service import long_run

DOC = "The quick brown fox jumps over the lazy dog. " * 8  # about 3 warm-up chunks on the tiny tokenizer


@pytest.fixture(scope="module")
def one_replica(tiny_llama_dir):
    cluster = af.init(replicas={str(tiny_llama_dir): 1}, num_cpus=2, dtype="float32", kv_cache_bytes=8 * 2**20)
    yield cluster, str(tiny_llama_dir)
    cluster.shutdown()


def reader(model: str):
    wf = af.Workflow("reader")
    doc = wf.context("doc", DOC)
    a = wf.agent("a", model, [doc, "Summarize."], max_tokens=8, ignore_eos=True)
    wf.agent("b", model, [doc, a, "Why?"], max_tokens=8, ignore_eos=True)
    wf.agent("c", model, [doc, "Title?"], max_tokens=8, ignore_eos=True)
    return wf


def _beside_a_decoding_run(cluster, model, before=None):
    """The reader run (its document cold) while another run decodes; (its result, the calls sent as
    (kind, sessions without run id, prompt tokens))."""
    replica = cluster.replicas()[0]
    ray.get(replica.actor.clear_prefix_cache.remote())
    backend = service_for(cluster).scheduler.backend
    calls, submit = [], backend.submit

    def watching(name, call):
        calls.append((call.kind.name, tuple(sid.split("/", 1)[1] for sid in call.sessions), call.tokens))
        return submit(name, call)

    decoding = threading.Event()
    talk = af.start(long_run(model, tokens=300), cluster, strategy="text", on_token=lambda *_: decoding.set())
    assert decoding.wait(60)
    if before is not None:
        before(replica)
    backend.submit = watching
    try:
        res = af.run(reader(model), cluster, strategy="transfer")
    finally:
        backend.submit = submit
        talk.cancel()
    with pytest.raises(af.RunCancelledError):
        talk.result(timeout=60)
    return res, calls


def _tokens(res) -> dict:
    return {n: a.token_ids for n, a in res.agents.items()}


def test_a_cold_prefix_is_warmed_in_chunks_beside_decode_steps(one_replica):
    cluster, model = one_replica
    expected = _tokens(af.run(reader(model), cluster, strategy="text"))
    res, calls = _beside_a_decoding_run(cluster, model)
    assert _tokens(res) == expected
    warm = [c for c in calls if any("warmup#" in sid for sid in c[1])]
    chunks = [c for c in warm if c[0] == "MIXED"]
    assert len(chunks) >= 2 and all("long" not in sid for c in chunks for sid in c[1][1:]), warm
    assert all(tokens - len(c[1]) + 1 <= WARM_CHUNK_TOKENS for c in chunks for tokens in [c[2]]), chunks
    assert warm[-1][0] == "CLOSE"
    # the materialize call reused the warmed blocks: the prefix was computed once in all
    prefix_tokens = next(tokens for kind, _, tokens in calls if kind == "MATERIALIZE")
    assert res.metrics["shared_prefill_computed"] == prefix_tokens > 2 * WARM_CHUNK_TOKENS
    assert_no_kv_left(cluster)


def test_a_refused_warmup_chunk_materializes_the_prefix_at_once(one_replica):
    cluster, model = one_replica
    expected = _tokens(af.run(reader(model), cluster, strategy="text"))
    res, calls = _beside_a_decoding_run(cluster, model, before=lambda r: ray.get(r.actor.inject_fault.remote("refuse")))
    assert _tokens(res) == expected
    kinds = [kind for kind, sessions, _ in calls if any("warmup#" in sid for sid in sessions)]
    assert kinds == ["OPEN", "MIXED", "CLOSE"], calls  # the refused chunk, then the session's close
    assert res.metrics["shared_prefill_computed"] == next(t for k, _, t in calls if k == "MATERIALIZE")
    assert_no_kv_left(cluster)
