"""Fuzzed workflows run for real: small random DAGs (chains, fan-outs, fan-ins, KV operator nodes)
with unicode, whitespace-only or one-character contexts, 1-8 or absurd max_tokens, per-agent
strategies, run with `af.run` under a random strategy and transport on a 2-replica tiny-model Ray
cluster. Property: a run completes with every agent's tokens or fails typed (`WorkflowError` for
what cannot fit); after it, no replica holds a block, a ref or a session.
"""

from __future__ import annotations

from aaflow.benchmarks.fuzz.harness import Surface
from aaflow.benchmarks.fuzz.op_args import _mostly

STRATEGIES = ["auto", "text", "recompute", "transfer", "stream", "transfer+stream"]
BAD_RUN_ARGUMENTS = ["fastest", "", None]  # a strategy that is none, or (None) no cluster: typed errors
TEXTS = [" ", "\n", "x", "é🙂 ünïcödé", "\t\t", "Shared context: keys and values. " * 6]


def _strategies():
    from hypothesis import strategies as st

    text = st.sampled_from(TEXTS) | st.text(st.characters(blacklist_categories=("Cs",)), min_size=1, max_size=60)
    max_tokens = _mostly(st.integers(1, 8), st.just(10**6))  # the absurd one must be refused before running
    agent = st.tuples(st.lists(st.integers(0, 9), max_size=3), text, max_tokens,
                      st.none() | st.sampled_from(STRATEGIES[1:]), st.booleans())
    op = st.tuples(st.sampled_from(["fork", "compose", "evict"]), st.lists(st.integers(0, 9), min_size=1, max_size=2))
    strategy = _mostly(st.sampled_from(STRATEGIES), st.sampled_from(BAD_RUN_ARGUMENTS))
    return st.tuples(st.lists(text, min_size=1, max_size=2), st.lists(agent, min_size=1, max_size=4),
                     st.lists(op, max_size=1), strategy, st.sampled_from(["ray", "nixl", "ucx"]))


class WorkflowRuns(Surface):
    """Random small workflows run on a real cluster (see the module doc)."""

    name = "workflow_runs"
    time_limit_s = 180.0

    def __init__(self, model: str) -> None:
        self.model = model

    def __enter__(self) -> "WorkflowRuns":
        import aaflow as af
        from aaflow.cluster.transports import available_transports

        super().__enter__()
        self.transports = {t for t, ok in available_transports().items() if ok is True}
        self.cluster = af.init(replicas={self.model: 2}, num_cpus=2, dtype="float32", kv_cache_bytes=8 * 2**20)
        return self

    def __exit__(self, *exc) -> None:
        self.cluster.shutdown()

    def cases(self):
        return _strategies()

    def run(self, case) -> None:
        import aaflow as af

        contexts, agents, ops, strategy, transport = case
        wf = af.Workflow("fuzz-run")
        handles = [wf.context(f"c{i}", text) for i, text in enumerate(contexts)]
        for i, (inputs, text, max_tokens, own_strategy, unordered) in enumerate(agents):
            parts = [handles[j % len(handles)] for j in inputs] + [text]
            handles.append(wf.agent(f"a{i}", self.model, parts, max_tokens=max_tokens, strategy=own_strategy,
                                    unordered=unordered, ignore_eos=True))
        for k, (op, inputs) in enumerate(ops):
            node = wf.kv_op(f"k{k}", op, *[handles[j % len(handles)] for j in inputs])
            wf.agent(f"after{k}", self.model, [node, "Go on."], max_tokens=2, ignore_eos=True)
        transport = transport if transport in self.transports else "ray"
        cluster, strategy = (None, "auto") if strategy is None else (self.cluster, strategy)  # None: no cluster
        result = af.run(wf, cluster, strategy=strategy, transport=transport, call_timeout_s=120)
        for agent in wf.agents():
            assert len(result[agent.name].token_ids) == agent.max_tokens, f"{agent.name} ended early"
        self.steps[f"ran {strategy}"] += 1

    def invariants(self) -> list[str]:
        import ray

        problems = []
        for r in self.cluster.replicas():
            stats, sessions = ray.get([r.actor.stats.remote(), r.actor.session_count.remote()], timeout=60)
            if stats["used_blocks"] or stats["refs"] or sessions:
                problems.append(f"{r.name}: {stats['used_blocks']} blocks, {stats['refs']} refs, {sessions} sessions")
                ray.get(r.actor.close.remote(), timeout=60)
        return problems
