"""Placement on a real two-replica cluster (SmolLM2, fp32): the readers of one document pile up on
the replica that computes it until its queue outweighs getting the document elsewhere, then go to
the idle replica, which receives the document's KV (the transfer operator) rather than computing
it; every reader answers with the tokens it gives under `text` (each prompt computed whole)."""

from __future__ import annotations

import pytest

import aaflow as af
from aaflow.cluster.ray_backend import service_for

pytestmark = pytest.mark.smollm2

DOCUMENT = ("The Amazon rainforest covers much of the Amazon basin in South America. It spans nine "
            "countries, with the majority in Brazil, and holds an estimated 390 billion trees. ") * 5
QUESTIONS = ["Which country holds most of the forest?", "How many trees does it hold?",
             "How many countries does it span?", "Where is the Amazon basin?",
             "Give this text a title.", "Summarize the text in five words."]


def _readers() -> af.Workflow:
    wf = af.Workflow("readers")
    doc = wf.context("doc", DOCUMENT)
    for i, question in enumerate(QUESTIONS):
        wf.agent(f"q{i}", "smollm2", [doc, question], max_tokens=8, ignore_eos=True)
    return wf


@pytest.fixture(scope="module")
def cluster(smollm2_dir):
    cluster = af.init(replicas={"smollm2": 2}, num_cpus=2, dtype="float32", kv_cache_bytes=64 * 2**20)
    yield cluster
    cluster.shutdown()


def test_readers_of_a_busy_replicas_document_move_it_to_the_idle_one_and_answer_as_text_does(cluster):
    before = service_for(cluster).scheduler.prefix_decisions()
    moved = af.run(_readers(), cluster, strategy="transfer")
    after = service_for(cluster).scheduler.prefix_decisions()
    text = af.run(_readers(), cluster, strategy="text")

    agents = moved.agents.values()
    holder = moved["q0"].replica  # the first reader's replica computes the document
    spilled = [a for a in agents if a.replica != holder]
    assert spilled and len(spilled) < len(QUESTIONS)  # both replicas read it
    assert sum(a.bytes_moved for a in agents) > 0  # its KV went to the other replica once
    done = {k: v["count"] - before.get(k, {}).get("count", 0) for k, v in after.items()}
    assert done.get("first") == 1 and sum(n for k, n in done.items() if k.startswith("move:")) == 1, after
    for name in moved.agents:
        assert moved[name].token_ids == text[name].token_ids, name


def test_prefix_fetch_compute_makes_the_idle_replica_compute_the_document_and_answers_as_text_does(cluster):
    before = service_for(cluster).scheduler.prefix_decisions()
    computed = af.run(_readers(), cluster, strategy="transfer", prefix_fetch="compute")
    after = service_for(cluster).scheduler.prefix_decisions()
    text = af.run(_readers(), cluster, strategy="text")

    agents = computed.agents.values()
    assert len({a.replica for a in agents}) == 2  # both replicas read it
    assert sum(a.bytes_moved for a in agents) == 0  # nothing moved: the second replica computed it
    done = {k: v["count"] - before.get(k, {}).get("count", 0) for k, v in after.items()}
    assert done.get("first") == 1 and done.get("compute") == 1, after
    assert not any(n for k, n in done.items() if k.startswith("move:")), after
    chosen = after["compute"]["chosen"] - before.get("compute", {}).get("chosen", 0)
    assert chosen == 0  # the run asked for it; the cost model did not choose it
    for name in computed.agents:
        assert computed[name].token_ids == text[name].token_ids, name


def test_an_unknown_prefix_fetch_is_refused_before_anything_runs(cluster):
    with pytest.raises(af.InvalidArgumentError, match="prefix_fetch must be one of auto, move, compute"):
        af.run(_readers(), cluster, prefix_fetch="sometimes")
