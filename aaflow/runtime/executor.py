"""The executor: a workflow's agents as scheduler state, and a run's `RunResult` collected from them."""

from __future__ import annotations

from aaflow.engine.sampling import SamplingParams
from aaflow.common.errors import WorkflowError
from aaflow.runtime.agent_state import AgentState
from aaflow.runtime.kvops import directive, evicted_contexts
from aaflow.runtime.prompts import AgentInput, prompt_leaves
from aaflow.runtime.results import RunResult
from aaflow.common.strategies import STRATEGIES
from aaflow.workflow.graph import AgentNode, ContextNode


def workflow_agents(workflow, builders: dict, strategy: str,
                    decisions: dict[str, str] | None = None) -> dict[str, AgentState]:
    """Each agent of `workflow` with its prompt segments (from its model's prompt builder), its
    readers and its strategy: its own `strategy=`, else the plan's decision, else `strategy`."""
    if strategy not in STRATEGIES:
        raise WorkflowError(f"unknown strategy {strategy!r}; choose one of {STRATEGIES}")
    evicted = evicted_contexts(workflow)
    readers: dict[str, list[str]] = {node.name: [] for node in workflow.agents()}  # in declaration order
    for node in workflow.agents():
        for up in node.upstream(workflow):
            readers[up].append(node.name)
    agents = {}
    for node in workflow.agents():
        chosen = node.strategy or (decisions or {}).get(node.name) or strategy
        kv = directive(workflow, node)
        if kv.share_prefix and chosen in ("recompute", "stream"):
            chosen = "transfer" if chosen == "recompute" else "transfer+stream"
        sampling = SamplingParams(max_new_tokens=node.max_tokens, temperature=node.temperature, top_p=node.top_p,
                                  seed=node.seed, ignore_eos=node.ignore_eos)
        segments = builders[node.model].segments(workflow, node)
        agents[node.name] = AgentState(
            node.name, node.model, chosen, segments, readers[node.name], node.max_tokens, sampling, node.ignore_eos,
            node.unordered, kv, evicts_prefix=bool(evicted & _leading_contexts(workflow, node)),
            prefix_parts=_composed_parts(workflow, node, builders[node.model], segments) if kv.compose else (),
            planned=not node.strategy and node.name in (decisions or {}))
    return agents


def _composed_parts(workflow, node: AgentNode, builder, segments) -> tuple[int, ...]:
    """The lengths of the contexts an approximate compose node composes: those at the start of the prompt."""
    lengths = builder.prefix_part_lengths(workflow, node)
    if len(lengths) < 2:
        raise WorkflowError(f"agent {node.name!r}: a compose node with mode rerotate or blend needs two or more "
                            "contexts at the start of the prompt (they are composed into its prefix)")
    assert sum(lengths) == len(segments[0]), "the composed contexts must make up the static prefix"
    return tuple(lengths)


def collect(workflow, agents: dict[str, AgentState], builders: dict, strategy: str, wall_s: float,
            events: list[str], shared_computed: int, start_s: float = 0.0, prefix: str = "") -> RunResult:
    """The `RunResult` of a run's ended agents: texts decoded, times counted from `start_s`, agent
    names without the `prefix` a shared scheduler gave them."""
    results = {}
    for agent in agents.values():
        r = agent.result
        r.token_ids = list(agent.output)
        r.text = builders[agent.model].tokenizer.decode(agent.output, skip_special_tokens=True)
        for attr in ("first_token_s", "last_token_s"):
            if getattr(r, attr) is not None:
                setattr(r, attr, getattr(r, attr) - start_s)
        ups = [agents[s.agent].result.last_token_s for s in agent.segments if isinstance(s, AgentInput)]
        if ups and r.first_token_s is not None:
            r.handoff_gap_s = r.first_token_s - max(ups)
        r.input_order = [s.agent.removeprefix(prefix) for s in agent.segments if isinstance(s, AgentInput)]
        results[r.name] = r
    return RunResult(workflow.name, strategy, results, wall_s, events, shared_computed)


def _leading_contexts(wf, node: AgentNode) -> set[str]:
    """Names of the contexts in the agent's static prefix."""
    names: set[str] = set()
    for leaf in prompt_leaves(wf, node):
        if not isinstance(leaf, ContextNode):
            break
        names.add(leaf.name)
    return names
