"""The workflows the benchmarks run: FlashAgents' chain, map-reduce and fan-out, and its A->B pairs.
Every agent generates its `max_tokens` with ignore_eos, so that all strategies do the same decode work."""

from __future__ import annotations

from aaflow.workflow.graph import Workflow


def chain_workflow(guide: str, max_tokens: int) -> Workflow:
    """4 agents (plan -> research -> draft -> edit), each reading the shared guide and its predecessor."""
    wf = Workflow("chain")
    g = wf.context("guide", guide)
    prev = None
    for name, task in [("plan", "Plan a short report following the guide."),
                       ("research", "List the key facts the plan needs."),
                       ("draft", "Write the report's first paragraph."),
                       ("edit", "Edit the draft for clarity.")]:
        prompt = [g] + (["Previous step:", prev] if prev is not None else []) + [task]
        prev = wf.agent(name, "smollm2", prompt, max_tokens=max_tokens, ignore_eos=True)
    return wf


def map_reduce_workflow(doc: str, max_tokens: int) -> Workflow:
    """3 reviewers and a meta-reviewer over one document."""
    wf = Workflow("map-reduce")
    d = wf.context("paper", doc)
    revs = [wf.agent(f"r_{aspect}", "smollm2", [d, f"You are a reviewer. In two sentences, assess the {aspect}."],
                     max_tokens=max_tokens, ignore_eos=True) for aspect in ("novelty", "method", "limitations")]
    wf.agent("meta", "smollm2", [d, "Reviews:", *revs, "As the meta-reviewer, give a one-sentence verdict."],
             max_tokens=max_tokens, ignore_eos=True)
    return wf


def fan_out_workflow(prefix: str, generators: int, max_tokens: int) -> Workflow:
    """1 analyzer -> `generators` generators sharing a prefix and the analyzer's output."""
    wf = Workflow("fan-out")
    p = wf.context("prefix", prefix)
    analysis = wf.agent("analyzer", "smollm2", [p, "Analyze the text: list its three main points."],
                        max_tokens=max_tokens, ignore_eos=True)
    for i in range(generators):
        wf.agent(f"gen{i}", "smollm2", [p, "Analysis:", analysis, f"Write test question number {i + 1}."],
                 max_tokens=max_tokens, ignore_eos=True)
    return wf


def pair_workflow(concurrency: int, system_prompt: str, a_tokens: int, b_model: str = "smollm2") -> Workflow:
    """FlashAgents' A->B microbenchmark: `concurrency` independent pairs; each B reads the system
    prompt and its A's output (A on SmolLM2, B on `b_model`)."""
    wf = Workflow(f"a-b-x{concurrency}")
    guide = wf.context("guide", system_prompt)
    for i in range(concurrency):
        a = wf.agent(f"A{i}", "smollm2", [f"Write a short paragraph about topic number {i}: the ocean."],
                     max_tokens=a_tokens, ignore_eos=True)
        wf.agent(f"B{i}", b_model, [guide, "Draft to improve:", a, "Rewrite it in one sentence."], max_tokens=16,
                 ignore_eos=True)
    return wf
