"""Shared by the vLLM cluster tests (test_vllm_cluster.py): the strategies compared with `text`, the
near-tie tolerance, the dtype, the shared document, workflows over it, and the checks that compare a
run's tokens with `text`'s or with a recomputation, accepting a difference only at a verified near-tie.
"""

from __future__ import annotations

import aaflow as af
from aaflow.engine.dtypes import resolve_dtype
from tests.cluster_checks import assert_no_kv_left

STRATEGIES = ["transfer", "stream"]
# vLLM on CPU is not batch-invariant: KV of a prefix computed in another forward (prefix cache,
# connector load, incremental prefill) differs from one-shot prefill by rounding, so greedy picks
# may flip where the top two logits are one or two ulps apart (bf16's: 0.125 near 16-32). A difference
# is accepted only there: the built-in engine's logit gap between the two tokens must be at most this
# (as in tests/engine/test_vllm_backend.py); the agents downstream of it then see other inputs and are not
# compared.
TIE_GAP = 0.5
DTYPE = resolve_dtype("auto")
PAPER = ("The report studies how teams of language-model agents share work. Each agent reads the same "
         "background document, writes a short answer, and passes it on. Caching the keys and values of "
         "the shared document saves most of the prefill time, and streaming an upstream agent's tokens "
         "into the next agent's prompt hides the rest. ") * 4  # ~300 tokens with the chat header


def _replica(cluster, model):
    return cluster.replicas(model)[0]


def chain(a_model, b_model):
    wf = af.Workflow("chain")
    paper = wf.context("paper", PAPER)
    a = wf.agent("A", a_model, [paper, "Summarize the report in one sentence."], max_tokens=14, ignore_eos=True)
    wf.agent("B", b_model, [paper, a, "Criticize this summary."], max_tokens=12, ignore_eos=True)
    return wf


def map_reduce(map_model, reduce_model):
    wf = af.Workflow("map-reduce")
    paper = wf.context("paper", PAPER)
    maps = [wf.agent(f"m{i}", map_model, [paper, f"Give finding {i} of the report."], max_tokens=10,
                     ignore_eos=True) for i in range(3)]
    wf.agent("reduce", reduce_model, [paper, *maps, "Combine the findings."], max_tokens=10, ignore_eos=True)
    return wf


def _prompt_ids(wf, name, outputs) -> list[int]:
    from aaflow.runtime import prompt_builders

    node = wf.nodes[name]
    builder = prompt_builders({node.model})[0][node.model]
    return [t for seg in builder.segments(wf, node) for t in (seg if isinstance(seg, tuple) else outputs[seg.agent])]


def _same_or_near_tie(ref_engine, prompt, expected: list[int], got: list[int], label: str) -> bool:
    """True if equal; False if they differ first at a near-tie (asserted); fails otherwise."""
    from tests.engine.test_vllm_backend import _builtin_gap, _first_divergence

    j = _first_divergence(expected, got)
    if j is None:
        return True
    assert j < min(len(expected), len(got)), f"{label}: lengths differ: {expected} vs {got}"
    gap = _builtin_gap(ref_engine, list(prompt) + list(expected[:j]), expected[j], got[j])
    print(f"{label}: near-tie at token {j}: {expected[j]} vs {got[j]}, built-in logit gap {gap:+.3f}")
    assert abs(gap) <= TIE_GAP, f"{label}: differs at {j} with logit gap {gap:.3f}: {expected} vs {got}"
    return False


def _recompute(cluster, replica_name, ids, max_tokens) -> list[int]:
    import ray

    actor = next(r.actor for r in cluster.replicas() if r.name == replica_name)
    ray.get(actor.clear_prefix_cache.remote())
    return ray.get(actor.generate_text.remote(ids, max_new_tokens=max_tokens, ignore_eos=True)).token_ids


def _check_strategies(cluster, wf, ref_engine):
    """Each strategy gives text's tokens, except past a verified near-tie (and downstream of it)."""
    baseline = af.run(wf, cluster, strategy="text", transport="ray")
    assert all(a.decoded == wf.nodes[n].max_tokens for n, a in baseline.agents.items())
    outputs = {n: a.token_ids for n, a in baseline.agents.items()}
    for strategy in STRATEGIES:
        res = af.run(wf, cluster, strategy=strategy, transport="ray")
        differs: set[str] = set()
        for node in wf.agents():  # in definition order, which is topological here
            name = node.name
            agent = res[name]
            label = f"{wf.name}/{strategy}/{name} on {agent.replica}"
            if set(node.upstream(wf)) & differs:  # its inputs differ from text's: compare with recomputing
                differs.add(name)                   # its actual prompt from text on its replica
                ids = _prompt_ids(wf, name, {n: a.token_ids for n, a in res.agents.items()})
                expected = _recompute(cluster, agent.replica, ids, node.max_tokens)
                _same_or_near_tie(ref_engine, ids, expected, agent.token_ids, label + " (vs recompute)")
                continue
            if not _same_or_near_tie(ref_engine, _prompt_ids(wf, name, outputs), outputs[name], agent.token_ids, label):
                differs.add(name)
        print(wf.name, strategy, {n: (a.replica, a.prefill_computed, a.prefill_reused, a.streamed_tokens)
                                  for n, a in res.agents.items()}, "near-tie:", sorted(differs))
    assert_no_kv_left(cluster)
    return baseline


def _remote_generate_equals_text(cluster, ref_engine, src_model, dst_model, back: bool = False):
    """materialize on src -> transfer to dst (-> back to src) -> generate == dst's generation from text."""
    import ray

    src, dst = _replica(cluster, src_model), _replica(cluster, dst_model)
    from transformers import AutoTokenizer

    from aaflow.models import resolve_model_path

    tokenizer = AutoTokenizer.from_pretrained(str(resolve_model_path("smollm2", quiet=True)))
    context = tokenizer.apply_chat_template([{"role": "user", "content": PAPER + "What does caching save?"}],
                                            tokenize=False, add_generation_prompt=True)
    ids = tokenizer.encode(context)
    k = len(ids) - 9
    kv = af.materialize(cluster, src_model, ids[:k], replica=src)
    moved = af.transfer(kv, dst, transport="ray")
    assert moved.replica.name == dst.name and moved.token_ids == tuple(ids[:k])
    final, target = moved, dst
    if back:
        final, target = af.transfer(moved, src, transport="ray"), src
        assert ray.get(src.actor.export_tensor.remote(final.id)).equal(ray.get(src.actor.export_tensor.remote(kv.id)))
    ray.get(target.actor.clear_prefix_cache.remote())  # the moved KV, not cached blocks, serves the prefix
    out = af.generate(final, ids[k:], max_new_tokens=16, ignore_eos=True)
    ray.get(target.actor.clear_prefix_cache.remote())  # and the baseline recomputes everything
    expected = ray.get(target.actor.generate_text.remote(ids, max_new_tokens=16, ignore_eos=True))
    for ref in {kv, moved, final}:
        af.free(ref)
    _same_or_near_tie(ref_engine, ids, expected.token_ids, out.token_ids, f"KV {src.name} -> {dst.name}"
                      + (f" -> {src.name}" if back else ""))

