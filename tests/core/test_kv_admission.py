"""No workflow fails because KV was momentarily short: admission queues what does not fit, and a
replica that refuses a call for lack of blocks preempts (the agent starts over later).

One replica whose pool holds two of the fan-out's prompts, fp32 (every strategy gives the same
tokens), a tiny random model with a byte tokenizer (one token per character)."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

import aaflow as af
from aaflow.common.strategies import STRATEGIES
from tests.cluster_checks import assert_no_kv_left
from tests.factories import make_tiny_model

DOC_TOKENS = 2800
ROOT_TOKENS, LEAF_TOKENS = 12, 8
PROMPT_TOKENS = DOC_TOKENS + 80 + ROOT_TOKENS + LEAF_TOKENS  # doc, chat header and task, input, output


@pytest.fixture(scope="module")
def small_pool(tmp_path_factory):
    model = make_tiny_model(tmp_path_factory.mktemp("tiny-long"), "llama", max_position_embeddings=4096)
    blocks = 2 * -(-PROMPT_TOKENS // 16)  # two of the prompts below, no more
    cluster = af.init(replicas={str(model): 1}, num_cpus=2, dtype="float32", num_blocks=blocks)
    yield cluster, str(model)
    cluster.shutdown()


def fan_out(model: str, name: str = "fan-out"):
    """1 -> 6 over a 2,800-token document."""
    wf = af.Workflow(name)
    doc = wf.context("doc", ("KV pools are finite; a scheduler must queue. " * 64)[:DOC_TOKENS])
    root = wf.agent("analyze", model, [doc, "Analyze."], max_tokens=ROOT_TOKENS, ignore_eos=True)
    for i in range(6):
        wf.agent(f"gen{i}", model, [doc, root, f"Variant {i}."], max_tokens=LEAF_TOKENS, ignore_eos=True)
    return wf


def test_a_fan_out_larger_than_the_pool_completes_under_every_strategy(small_pool):
    cluster, model = small_pool
    wf = fan_out(model)
    baseline = af.run(wf, cluster, strategy="text")
    assert all(a.decoded == (ROOT_TOKENS if n == "analyze" else LEAF_TOKENS) for n, a in baseline.agents.items())
    for strategy in STRATEGIES:
        res = af.run(wf, cluster, strategy=strategy)
        for name, agent in res.agents.items():
            assert agent.token_ids == baseline[name].token_ids, f"{strategy}/{name} differs from text"
        # admission queued what did not fit: nothing had to be preempted
        assert not any("preempted" in e for e in res.events), (strategy, res.events)
        assert_no_kv_left(cluster)


def test_two_runs_at_once_share_one_admission_and_both_complete(small_pool):
    """Runs from two threads go to the cluster's one scheduler: admission reserves the pool across
    both (each alone fills it), so the second run's agents queue instead of being refused, and
    both give text's tokens."""
    cluster, model = small_pool
    expected = af.run(fan_out(model), cluster, strategy="text-nocache")
    with ThreadPoolExecutor(max_workers=2) as pool:
        results = list(pool.map(lambda i: af.run(fan_out(model, f"run{i}"), cluster, strategy="text-nocache"),
                                range(2)))
    for res in results:
        for name, agent in res.agents.items():
            assert agent.token_ids == expected[name].token_ids, name
    assert not any("preempted" in e for res in results for e in res.events), [r.events for r in results]
    assert_no_kv_left(cluster)


def test_a_prompt_no_pool_can_hold_is_refused_before_anything_runs(small_pool):
    _, model = small_pool
    cluster = af.init(replicas={model: 1}, num_cpus=2, dtype="float32", num_blocks=64)  # 1,024 tokens
    try:
        wf = af.Workflow("too-big")
        wf.agent("huge", model, ["x" * 2000], max_tokens=4)  # within the model's positions
        with pytest.raises(af.WorkflowError, match="'huge'.*KV pool.*kv_cache_bytes"):
            af.run(wf, cluster, strategy="text")
        assert_no_kv_left(cluster)
    finally:
        cluster.shutdown()


@pytest.mark.parametrize("strategy", ["transfer", "text"])
def test_kv_held_outside_the_run_makes_it_wait_not_fail(small_pool, strategy):
    """Another program's context fills most of the pool, so the run's shared-prefix materialize
    (transfer) or prompt prefill (text) is refused; the refused agents back off and retry, and
    once that context is freed the run completes with text's tokens."""
    import threading

    cluster, model = small_pool
    wf = fan_out(model)
    expected = af.run(wf, cluster, strategy="text")
    other = af.materialize(cluster, model, "Another program's context. " * 110)  # ~3,000 of ~5,900 tokens
    release = threading.Timer(2.0, af.free, args=(other,))
    release.start()
    try:
        res = af.run(wf, cluster, strategy=strategy)
    finally:
        release.join()
    for name, agent in res.agents.items():
        assert agent.token_ids == expected[name].token_ids, name
    assert any("preempted" in e for e in res.events), res.events
    assert_no_kv_left(cluster)
