"""The workflow DSL: contexts, agents and explicit KV operator nodes in a DAG.

    wf = Workflow("review")
    doc = wf.context("paper", text)
    revs = [wf.agent(f"r{i}", model="smollm2", prompt=[doc, f"Review {aspect}"]) for i, aspect in ...]
    meta = wf.agent("meta", model="smollm2", prompt=[doc, *revs, "Summarize"], max_tokens=64)

Prompt parts are strings, contexts, other agents (their output text), or KV operator nodes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal, Union

from aaflow.errors import WorkflowError
from aaflow.strategies import STRATEGIES


@dataclass(frozen=True)
class ContextNode:
    """A static document or instruction every agent that names it reads."""

    name: str
    text: str


@dataclass(frozen=True)
class KVOpNode:
    """A KV operator the user declares explicitly on a context or agent output."""

    name: str
    op: Literal["fork", "transfer", "compose", "evict"]
    inputs: tuple[str, ...]
    options: tuple[tuple[str, str], ...] = ()


@dataclass(frozen=True)
class AgentNode:
    """An LLM call: its prompt is the concatenation of its parts, in order.

    Attributes:
        model: the model name the cluster serves.
        system: optional system prompt (placed first, static).
        prompt: parts: literal strings, or names of contexts / agents / KV operator nodes.
        max_tokens: tokens to generate.
        temperature / top_p / seed: sampling (temperature 0 = greedy).
        unordered: the executor may order agent inputs by completion (fan-in).
        strategy: per-agent override of the run's strategy for its incoming edges.
        ignore_eos: generate exactly max_tokens (benchmarks need equal lengths across strategies).
        history: earlier turns of a conversation, (role, content) pairs with role "user" or
            "assistant", placed after the system prompt and before this turn (static).
    """

    name: str
    model: str
    prompt: tuple[Union[str, "Ref"], ...]
    system: str | None = None
    max_tokens: int = 64
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    unordered: bool = False
    strategy: str | None = None
    ignore_eos: bool = False
    history: tuple[tuple[str, str], ...] = ()

    def inputs(self) -> list[str]:
        return [p.name for p in self.prompt if isinstance(p, Ref)]

    def upstream(self, wf: "Workflow") -> list[str]:
        """Names of the agents whose output this agent's prompt reads (through KV operator nodes too)."""
        names: list[str] = []

        def visit(name: str) -> None:
            node = wf.nodes[name]
            if isinstance(node, KVOpNode):
                for inner in node.inputs:
                    visit(inner)
            elif isinstance(node, AgentNode) and name not in names:
                names.append(name)

        for name in self.inputs():
            visit(name)
        return names


@dataclass(frozen=True)
class Ref:
    """A reference to another node inside a prompt (what `wf.context`/`wf.agent` return)."""

    name: str
    kind: Literal["context", "agent", "kvop"]


Node = Union[ContextNode, AgentNode, KVOpNode]


@dataclass
class Workflow:
    """A named DAG of contexts, agents and KV operator nodes. Build it with the methods below."""

    name: str
    nodes: dict[str, Node] = field(default_factory=dict)

    def _add(self, node: Node, kind: str) -> Ref:
        if not isinstance(node.name, str) or not node.name.strip():
            raise WorkflowError(f"workflow {self.name!r}: node names must be non-empty strings, got {node.name!r}")
        if node.name in self.nodes:
            raise WorkflowError(f"workflow {self.name!r}: node {node.name!r} is defined twice")
        self.nodes[node.name] = node
        return Ref(node.name, kind)  # type: ignore[arg-type]

    def context(self, name: str, text: str) -> Ref:
        """A static context (document, guide, shared instructions)."""
        if not isinstance(text, str) or not text:
            raise WorkflowError(f"context {name!r}: text must be a non-empty string, got {text!r:.40}")
        _check_unicode(f"context {name!r}", text)
        return self._add(ContextNode(name, text), "context")

    def agent(self, name: str, model: str, prompt: list, system: str | None = None, max_tokens: int = 64,
              temperature: float = 0.0, top_p: float = 1.0, seed: int | None = None, unordered: bool = False,
              strategy: str | None = None, ignore_eos: bool = False, history=()) -> Ref:
        """An agent; `prompt` parts are strings or the handles returned by context/agent/kv-op calls;
        `history` earlier turns of its conversation (`{"role", "content"}` dicts or pairs, role
        "user" or "assistant"), rendered by the model's chat template before this turn."""
        parts = tuple(self._part(name, p) for p in (prompt if isinstance(prompt, (list, tuple)) else [prompt]))
        if not parts:
            raise WorkflowError(f"agent {name!r}: the prompt is empty")
        _check_agent_settings(name, model, system, max_tokens, temperature, top_p, seed, unordered, ignore_eos)
        if strategy is not None and strategy not in STRATEGIES:
            raise WorkflowError(f"agent {name!r}: unknown strategy {strategy!r}; choose one of {STRATEGIES}")
        node = AgentNode(name, model, parts, system, max_tokens, temperature, top_p, seed, unordered, strategy,
                         ignore_eos, _checked_history(name, history))
        return self._add(node, "agent")

    def kv_op(self, name: str, op: str, *inputs: Ref, **options) -> Ref:
        """Declare a KV operator node (fork / transfer / compose / evict) over contexts or agents."""
        if not isinstance(op, str) or op not in ("fork", "transfer", "compose", "evict"):
            raise WorkflowError(f"kv op {name!r}: unknown operator {op!r}; use fork, transfer, compose or evict")
        if not inputs:
            raise WorkflowError(f"kv op {name!r}: {op} needs at least one input (a context, agent or kv op handle)")
        if not all(isinstance(i, Ref) for i in inputs):
            got = next(type(i).__name__ for i in inputs if not isinstance(i, Ref))
            raise WorkflowError(f"kv op {name!r}: inputs must be handles from wf.context/agent/kv_op, got {got}")
        names = tuple(self._part(name, i).name for i in inputs)
        opts = tuple(sorted((k, str(v)) for k, v in options.items()))
        return self._add(KVOpNode(name, op, names, opts), "kvop")  # type: ignore[arg-type]

    def _part(self, owner: str, part) -> Union[str, Ref]:
        if isinstance(part, str):
            _check_unicode(f"node {owner!r}", part)
            return part
        if isinstance(part, Ref):
            if not isinstance(part.name, str) or part.name not in self.nodes:
                raise WorkflowError(f"node {owner!r} refers to unknown node {part.name!r}")
            return part
        raise WorkflowError(f"node {owner!r}: a prompt part must be a string or a node handle, got {type(part).__name__}")

    # --- structure ------------------------------------------------------------------------
    def agents(self) -> list[AgentNode]:
        return [n for n in self.nodes.values() if isinstance(n, AgentNode)]

    def dependencies(self, name: str) -> list[str]:
        node = self.nodes[name]
        if isinstance(node, AgentNode):
            return node.inputs()
        if isinstance(node, KVOpNode):
            return list(node.inputs)
        return []

    def topological_order(self) -> list[str]:
        """Node names, every node after its inputs; raises `WorkflowError` naming a cycle or unknown node."""
        order: list[str] = []
        state: dict[str, int] = {}  # 1 = visiting, 2 = done

        def visit(name: str, path: list[str]) -> None:
            if name not in self.nodes:
                raise WorkflowError(f"node {path[-1]!r} refers to unknown node {name!r}")
            if state.get(name) == 2:
                return
            if state.get(name) == 1:
                cycle = path[path.index(name):] + [name]
                raise WorkflowError(f"workflow {self.name!r} has a cycle: {' -> '.join(cycle)}")
            state[name] = 1
            for dep in self.dependencies(name):
                visit(dep, path + [dep])
            state[name] = 2
            order.append(name)

        for name in self.nodes:
            visit(name, [name])
        return order

    def validate(self, served_models: set[str] | None = None) -> None:
        """Check the graph before anything runs: prompt parts, cycles, unknown references, unserved models."""
        for agent in self.agents():
            for part in agent.prompt:
                if not (isinstance(part, str) or isinstance(part, Ref) and isinstance(part.name, str)):
                    raise WorkflowError(f"agent {agent.name!r}: prompt part {part!r:.60} is neither a string nor a "
                                        "node handle; build prompts with wf.context / wf.agent handles")
        self.topological_order()
        if not self.agents():
            raise WorkflowError(f"workflow {self.name!r} has no agents")
        if served_models is not None:
            for agent in self.agents():
                if agent.model not in served_models:
                    raise WorkflowError(
                        f"agent {agent.name!r} uses model {agent.model!r}, which the cluster does not serve "
                        f"(served: {sorted(served_models)}); start it with af.init(replicas={{{agent.model!r}: 1}})"
                    )


def _check_unicode(owner: str, text: str) -> None:
    """`WorkflowError` for text no tokenizer can encode (unpaired surrogates)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise WorkflowError(f"{owner}: the text is not valid unicode ({exc.reason} at character {exc.start}); "
                            "remove unpaired surrogates") from exc


def _is_number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _checked_history(name: str, history) -> tuple[tuple[str, str], ...]:
    """`history` as (role, content) pairs; `WorkflowError` naming the first bad turn."""
    if not isinstance(history, (list, tuple)):
        raise WorkflowError(f"agent {name!r}: history must be a list of turns, got {type(history).__name__}")
    turns = []
    for i, turn in enumerate(history):
        role, content = (turn.get("role"), turn.get("content")) if isinstance(turn, dict) else (
            turn if isinstance(turn, (list, tuple)) and len(turn) == 2 else (None, None))
        if role not in ("user", "assistant") or not isinstance(content, str):
            raise WorkflowError(f"agent {name!r}: history turn {i} must have role 'user' or 'assistant' and string "
                                f"content, got {turn!r:.80}")
        _check_unicode(f"agent {name!r}'s history turn {i}", content)
        turns.append((role, content))
    return tuple(turns)


def _check_agent_settings(name, model, system, max_tokens, temperature, top_p, seed, unordered, ignore_eos) -> None:
    """`WorkflowError` naming the first agent setting of the wrong type or out of range."""
    if not isinstance(model, str) or not model.strip():
        raise WorkflowError(f"agent {name!r}: model must be a served model's name (a non-empty string), got {model!r}")
    if system is not None and not isinstance(system, str):
        raise WorkflowError(f"agent {name!r}: system must be a string or None, got {type(system).__name__}")
    if system is not None:
        _check_unicode(f"agent {name!r}'s system prompt", system)
    if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
        raise WorkflowError(f"agent {name!r}: max_tokens must be an int >= 1, got {max_tokens!r}")
    if not _is_number(temperature) or temperature < 0:
        raise WorkflowError(f"agent {name!r}: temperature must be a finite number >= 0, got {temperature!r}")
    if not _is_number(top_p) or not 0 < top_p <= 1:
        raise WorkflowError(f"agent {name!r}: top_p must be a number in (0, 1], got {top_p!r}")
    if seed is not None and (not isinstance(seed, int) or isinstance(seed, bool)):
        raise WorkflowError(f"agent {name!r}: seed must be an int or None, got {seed!r}")
    for flag, value in (("unordered", unordered), ("ignore_eos", ignore_eos)):
        if not isinstance(value, bool):
            raise WorkflowError(f"agent {name!r}: {flag} must be true or false, got {value!r}")
