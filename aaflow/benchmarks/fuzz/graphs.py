"""Workflow graphs built with the DSL: random node names (empty, unicode, duplicates, junk), prompts
(empty, enormous, unicode, dangling or foreign handles), agent settings (huge or negative
max_tokens, NaN temperatures, unknown models and strategies), KV operator nodes, and graphs whose
nodes are wired by hand (cycles, dangling references) as a program that edits `wf.nodes` would.

Each graph is validated against the served model, size-checked against its positions and planned
offline on a projected profile (what `af.run` does before anything runs); every refusal must be a
`WorkflowError` or another typed error.
"""

from __future__ import annotations

from aaflow.benchmarks.fuzz.harness import Surface

NAMES = ["doc", "a", "b", "c", "meta", "", " ", "é", "🙂", "a" * 300]
JUNK = [None, 7, 1.5, b"x", ["a"], {"a": 1}]


def _mostly(valid, invalid):
    from hypothesis import strategies as st

    return st.integers(0, 3).flatmap(lambda i: invalid if i == 3 else valid)


def _strategies(model: str):
    from hypothesis import strategies as st

    junk = st.sampled_from(JUNK)
    name = _mostly(st.sampled_from(NAMES[:5]), st.sampled_from(NAMES[5:]) | st.text(max_size=8) | junk)
    text = _mostly(st.text(min_size=1, max_size=30),
                   st.sampled_from(["", "\ud800", "\x00"]) | st.integers(1, 4000).map(lambda n: "word " * n) | junk)
    part = _mostly(st.integers(0, 9), st.tuples(st.just("ref"), name) | st.tuples(st.just("junk"), junk)) | text
    valid_settings = st.fixed_dictionaries({}, optional={
        "max_tokens": st.integers(1, 64), "temperature": st.floats(0, 2), "top_p": st.floats(0.01, 1),
        "seed": st.none() | st.integers(0, 9), "system": st.none() | st.text(min_size=1, max_size=20),
        "strategy": st.sampled_from([None, "auto", "text", "stream", "transfer", "recompute"]),
        "unordered": st.booleans()})
    any_settings = st.fixed_dictionaries({}, optional={
        "max_tokens": st.integers(-5, 0) | st.sampled_from([10**12, True]) | junk,
        "temperature": st.floats(allow_nan=True) | junk, "top_p": st.floats(allow_nan=True) | junk,
        "seed": junk, "strategy": st.text(max_size=5) | junk, "system": text, "unordered": junk})
    settings = _mostly(valid_settings, any_settings)
    model_name = _mostly(st.just(model), st.sampled_from(["smollm3", "", "gpt-9"]) | junk)
    context = st.tuples(st.just("context"), name, text)
    prompt = _mostly(st.lists(part, min_size=1, max_size=4), st.just([]))
    agent = st.tuples(st.just("agent"), name, model_name, prompt, settings)
    kv_op = st.tuples(st.just("kv_op"), name, _mostly(st.sampled_from(["fork", "compose", "evict"]), text),
                      st.lists(_mostly(st.integers(0, 9), part), max_size=3))
    wired = st.tuples(st.just("wired"), name, st.lists(name, min_size=1, max_size=3))  # by hand: cycles, dangling
    return st.lists(_mostly(st.one_of(context, agent, kv_op), wired), min_size=1, max_size=8)


class WorkflowGraphs(Surface):
    """DSL graphs, validated, size-checked and planned as `af.run` would before running them."""

    name = "workflow_graphs"

    def __init__(self, model: str) -> None:
        self.model = model

    def cases(self):
        return _strategies(self.model)

    def run(self, case) -> None:
        import aaflow as af
        from aaflow.workflow.graph import AgentNode, Ref

        wf = af.Workflow("fuzz")
        handles: list = []
        for step in case:
            kind, name, *rest = step
            try:
                if kind == "context":
                    handles.append(wf.context(name, rest[0]))
                elif kind == "agent":
                    model, parts, settings = rest
                    handles.append(wf.agent(name, model, [self._part(p, handles) for p in parts], **settings))
                elif kind == "kv_op":
                    op, parts = rest
                    handles.append(wf.kv_op(name, op, *[self._part(p, handles) for p in parts]))
                else:  # wired by hand, bypassing the DSL's checks (the graph checks must catch it)
                    prompt = tuple(Ref(n, "agent") if isinstance(n, str) else n for n in rest[0])
                    wf.nodes[str(name)] = AgentNode(str(name), self.model, prompt, max_tokens=4)
            except af.WorkflowError as exc:
                self.steps[f"{kind}: {type(exc).__name__}"] += 1
            else:
                self.steps[f"{kind}: ok"] += 1
        af.plan(wf, {self.model: 2}, hardware="h100", progress=None, dtype="float32")

    @staticmethod
    def _part(part, handles: list):
        from aaflow.workflow.graph import Ref

        if isinstance(part, int):
            return handles[part % len(handles)] if handles else "text"
        if isinstance(part, tuple):
            return Ref(part[1], "context") if part[0] == "ref" else part[1]
        return part
