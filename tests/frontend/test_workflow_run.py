"""Workflows on a real local Ray cluster: every strategy gives the text baseline's tokens."""

from __future__ import annotations

import pytest
import ray

import aaflow as af
from tests.cluster_checks import assert_no_kv_left

STRATEGIES = ["text", "recompute", "transfer", "stream", "auto"]
DOC = "Shared context: KV caches keep keys and values. " * 8


@pytest.fixture(scope="module")
def tiny_cluster(tiny_llama_dir):
    from aaflow.cluster.calibration import ensure_profile

    cluster = af.init(replicas={str(tiny_llama_dir): 2}, num_cpus=2, dtype="float32", kv_cache_bytes=8 * 2**20)
    ensure_profile(cluster)  # auto's planner calibrates on first use: do it before any counter is read
    yield cluster, str(tiny_llama_dir)
    cluster.shutdown()


def chain(model):
    wf = af.Workflow("chain")
    guide = wf.context("guide", DOC)
    a = wf.agent("plan", model, [guide, "Plan."], max_tokens=10)
    b = wf.agent("draft", model, [guide, a, "Draft."], max_tokens=10)
    c = wf.agent("edit", model, [guide, b, "Edit."], max_tokens=10)
    wf.agent("final", model, [guide, c, "Finish."], max_tokens=8)
    return wf


def fan_out(model):
    wf = af.Workflow("fan-out")
    doc = wf.context("doc", DOC)
    root = wf.agent("analyze", model, [doc, "Analyze."], max_tokens=12)
    for i in range(4):
        wf.agent(f"gen{i}", model, [doc, root, f"Variant {i}."], max_tokens=8)
    return wf


def fan_in(model):
    wf = af.Workflow("fan-in")
    ups = [wf.agent(f"src{i}", model, [f"Source {i} says hello."], max_tokens=6 + i) for i in range(3)]
    wf.agent("join", model, [*ups, "Combine."], max_tokens=8)
    return wf


def map_reduce(model):
    wf = af.Workflow("map-reduce")
    paper = wf.context("paper", DOC)
    revs = [wf.agent(f"r{i}", model, [paper, f"Review aspect {i}."], max_tokens=10) for i in range(3)]
    wf.agent("meta", model, [paper, *revs, "Meta-review."], max_tokens=10)
    return wf


@pytest.mark.parametrize("build", [chain, fan_out, fan_in, map_reduce])
def test_every_strategy_gives_the_text_baselines_tokens(tiny_cluster, build):
    cluster, model = tiny_cluster
    wf = build(model)
    baseline = af.run(wf, cluster, strategy="text")
    assert all(a.decoded > 0 for a in baseline.agents.values())
    for strategy in STRATEGIES[1:]:
        res = af.run(wf, cluster, strategy=strategy)
        for name, agent in res.agents.items():
            assert agent.token_ids == baseline[name].token_ids, f"{wf.name}/{strategy}/{name} differs from text"
    assert_no_kv_left(cluster)


@pytest.mark.parametrize("chunk", [1, 10_000])
def test_streaming_prefills_upstream_tokens_while_they_are_decoded(tiny_cluster, chunk):
    cluster, model = tiny_cluster
    wf = chain(model)
    baseline = af.run(wf, cluster, strategy="text")
    res = af.run(wf, cluster, strategy="stream", chunk_tokens=chunk)
    assert {n: a.token_ids for n, a in res.agents.items()} == {n: a.token_ids for n, a in baseline.agents.items()}
    if chunk == 1:
        assert res["draft"].streamed_tokens > 0, "upstream tokens must be prefilled while upstream decodes"
    else:
        assert res.metrics["streamed_tokens"] == 0


def _computed(cluster) -> int:
    import ray

    return sum(ray.get(r.actor.stats.remote())["tokens_computed"] for r in cluster.replicas())


def _cold(cluster) -> None:
    import ray

    ray.get([r.actor.clear_prefix_cache.remote() for r in cluster.replicas()])


def _questions_on_doc(model, n: int):
    """n agents, each asking its own question about one shared context."""
    wf = af.Workflow("sharing")
    doc = wf.context("doc", DOC)
    for i in range(n):
        wf.agent(f"a{i}", model, [doc, f"Question {i}."], max_tokens=4)
    return wf


@pytest.mark.parametrize("strategy", ["text-nocache", "text", "transfer+stream", "stream", "auto"])
def test_shared_prefix_is_computed_once_not_once_per_agent(tiny_cluster, strategy):
    """Six concurrent agents share a P-token prefix: text-nocache computes 6 P; transfer+stream
    computes P once and transfers it (each fork computes its own words, less whole blocks of them an
    earlier fork cached); text and stream share it through the prefix cache of each
    replica (full blocks); auto follows the planner, whose choices are among those kinds."""
    cluster, model = tiny_cluster
    wf = _questions_on_doc(model, 6)
    _cold(cluster)
    before = _computed(cluster)
    res = af.run(wf, cluster, strategy=strategy)
    computed = _computed(cluster) - before
    decode_steps = sum(a.decoded - 1 for a in res.agents.values())
    prompts = [a.prompt_tokens for a in res.agents.values()]
    prefix = len(DOC.encode()) + 20  # byte tokenizer: the doc plus the chat header, roughly
    if strategy == "text-nocache":
        assert computed == sum(prompts) + decode_steps and res.metrics["prefill_reused"] == 0
    elif strategy == "transfer+stream":
        per_token = ray.get(cluster.replicas()[0].actor.info.remote())["bytes_per_token"]
        shared, rest = divmod(res.metrics["bytes_moved"], per_token)  # the prefix crosses to the other replica once
        assert shared >= len(DOC.encode()) and rest == 0
        reused = [a.prefill_reused for a in res.agents.values()]  # its fork, and words a fork before it cached
        assert min(reused) >= shared
        assert computed == shared + sum(p - r for p, r in zip(prompts, reused)) + decode_steps
        assert res.metrics["prefill_computed"] == computed - decode_steps  # the shared prefix is counted once
    else:
        if strategy == "auto":
            assert any(e.startswith("planner (") for e in res.events) and res.metrics["planning_s"] > 0
            assert res.total_s >= res.wall_s + res.planning_s, "end to end: the planning and the run"
        assert computed <= 2 * prefix + sum(prompts) - 6 * (prefix - 2 * 16) + decode_steps
        assert res.metrics["prefill_reused"] >= 4 * (len(DOC.encode()) // 16 * 16 - 16)


def test_a_context_read_by_many_agents_is_tokenized_once_per_run(tiny_cluster):
    """A run's prompt builder memoizes its texts: six agents over one document tokenize it once
    (and get the same ids as tokenizing it alone); the run's end-to-end time (`total_s`) covers
    the run's own wall time."""
    from aaflow.runtime import prompt_builders

    cluster, model = tiny_cluster
    builder = prompt_builders({model})[0][model]
    encoded = []
    encode = builder.tokenizer.encode
    builder.tokenizer.encode = lambda text, **kw: encoded.append(text) or encode(text, **kw)
    try:
        wf = _questions_on_doc(model, 6)
        firsts = {builder.segments(wf, agent)[0] for agent in wf.agents()}
    finally:
        del builder.tokenizer.encode
    assert encoded.count(DOC) == 1 and len(firsts) == 1
    assert tuple(encode(DOC, add_special_tokens=False)) == builder.ids(DOC)
    res = af.run(wf, cluster, strategy="text")
    assert res.total_s >= res.wall_s > 0


def test_kv_operator_nodes_share_place_and_evict(tiny_cluster):
    """A fork node shares the context's KV even under `stream`; a transfer node places its agent;
    an evict node evicts the shared prefix once both agents forked it; tokens equal `text`."""
    cluster, model = tiny_cluster
    target = cluster.replicas()[1].name

    def build(with_ops: bool):
        wf = af.Workflow("kv-ops")
        doc = wf.context("doc", DOC)
        shared = wf.kv_op("shared", "fork", doc) if with_ops else doc
        moved = wf.kv_op("moved", "transfer", doc, replica=target) if with_ops else doc
        a = wf.agent("a", model, [shared, "First."], max_tokens=6)
        wf.agent("b", model, [moved, a, "Second."], max_tokens=6)
        if with_ops:
            wf.kv_op("drop", "evict", doc)
        return wf

    baseline = af.run(build(False), cluster, strategy="text")
    res = af.run(build(True), cluster, strategy="stream")
    for name in ("a", "b"):
        assert res[name].token_ids == baseline[name].token_ids
    assert res["b"].replica == target and res["a"].strategy == "transfer+stream"
    assert res["a"].prefill_reused >= len(DOC.encode()) and res["b"].prefill_reused >= len(DOC.encode())
    assert any("evicted a shared prefix" in e for e in res.events)
    assert_no_kv_left(cluster)


@pytest.mark.parametrize("mode", ["rerotate", "blend"])
def test_a_compose_node_composes_separately_materialized_contexts(tiny_cluster, mode):
    """[compose(A, B), question]: A and B are materialized apart and their KV composed; the agent
    forks the composed prefix and reports the compose's fidelity. Run again, both contexts come
    from the prefix cache: only each one's last partial block and blend's recompute budget are
    computed."""
    cluster, model = tiny_cluster
    wf = af.Workflow("compose")
    a, b = wf.context("a", DOC[:200]), wf.context("b", "Second context: values follow keys. " * 4)
    wf.agent("q", model, [wf.kv_op("both", "compose", a, b, mode=mode, r=0.25), "Question."], max_tokens=4)
    _cold(cluster)
    cold, warm = (af.run(wf, cluster, strategy="transfer") for _ in range(2))
    prefix = cold["q"].prefill_reused  # forked: the composed prefix
    assert prefix > 200 + 140 and warm["q"].prefill_reused == prefix
    for res in (cold, warm):
        report = res["q"].fidelity
        assert report is not None and report.mode == mode and not report.exact and report.total_tokens == prefix
        assert res["q"].prefill_computed == res["q"].prompt_tokens - prefix  # only what follows the prefix
    recomputed = warm["q"].fidelity.recomputed_tokens
    if mode == "rerotate":
        assert recomputed == 0
    else:
        assert 0 < recomputed <= 0.25 * prefix
    assert cold.shared_prefill_computed == prefix + recomputed  # both contexts computed, each alone
    assert warm.shared_prefill_computed <= 2 * 16 + recomputed  # the prefix cache served the rest
    assert_no_kv_left(cluster)


def test_transfer_node_to_an_unknown_replica_is_refused(tiny_cluster):
    cluster, model = tiny_cluster
    wf = af.Workflow("bad-target")
    doc = wf.context("doc", DOC)
    wf.agent("a", model, [wf.kv_op("moved", "transfer", doc, replica="nowhere-7"), "Go."], max_tokens=2)
    with pytest.raises(af.WorkflowError, match="nowhere-7"):
        af.run(wf, cluster)


@pytest.mark.parametrize("strategy", ["text", "stream", "auto"])
def test_unordered_inputs_follow_completion_and_match_recomputing_that_prompt(tiny_cluster, strategy):
    """`unordered=True`: the fan-in agent reads its inputs in completion order (the short one
    first); its tokens equal an ordered run of the prompt in the order it recorded."""
    cluster, model = tiny_cluster

    def build(order, unordered):
        wf = af.Workflow("unordered")
        ups = {f"u{i}": wf.agent(f"u{i}", model, [f"Source {i}."], max_tokens=n, ignore_eos=True)
               for i, n in enumerate((14, 3))}
        wf.agent("join", model, [*(ups[n] for n in order), "Combine."], max_tokens=6, unordered=unordered)
        return wf

    res = af.run(build(["u0", "u1"], True), cluster, strategy=strategy)
    order = res["join"].input_order
    assert sorted(order) == ["u0", "u1"]
    if strategy != "text":  # u1 (3 tokens) finishes long before u0 (14)
        assert order == ["u1", "u0"]
    ordered = af.run(build(order, False), cluster, strategy="text")
    assert res["join"].token_ids == ordered["join"].token_ids
    assert_no_kv_left(cluster)


def test_a_long_prefill_borrows_the_idle_replicas_threads(tiny_cluster):
    """The shared prefix is materialized while the other replica has nothing to do: it runs on both
    replicas' threads (the events say so), with the tokens of a run that lends nothing (fp32)."""
    cluster, model = tiny_cluster
    wf = _questions_on_doc(model, 2)
    _cold(cluster)
    lent = af.run(wf, cluster, strategy="transfer")
    _cold(cluster)
    alone = af.run(wf, cluster, strategy="transfer", lend_cores=False)
    assert any("lent by idle replicas" in e for e in lent.events), lent.events
    assert not any("lent by idle replicas" in e for e in alone.events)
    assert all(lent[n].token_ids == alone[n].token_ids for n in ("a0", "a1"))
    assert_no_kv_left(cluster)


def test_concurrent_runs_from_several_threads_share_the_replicas(tiny_cluster):
    """Sixteen workflows run at once from eight driver threads on one cluster: every run
    completes with its own serial tokens (session names never collide), and nothing is left."""
    from concurrent.futures import ThreadPoolExecutor

    cluster, model = tiny_cluster
    builds = [chain, fan_out, fan_in, map_reduce]
    serial = {b.__name__: af.run(b(model), cluster, strategy="text") for b in builds}
    jobs = [(builds[i % 4], ["auto", "text", "stream", "transfer"][i // 4]) for i in range(16)]
    with ThreadPoolExecutor(max_workers=8) as pool:
        results = list(pool.map(lambda job: af.run(job[0](model), cluster, strategy=job[1]), jobs))
    for (build, strategy), res in zip(jobs, results):
        for name, agent in res.agents.items():
            assert agent.token_ids == serial[build.__name__][name].token_ids, f"{build.__name__}/{strategy}/{name}"
    assert_no_kv_left(cluster)
