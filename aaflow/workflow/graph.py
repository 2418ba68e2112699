"""The workflow DSL: contexts, agents and explicit KV operator nodes in a DAG.

    wf = Workflow("review")
    doc = wf.context("paper", text)
    revs = [wf.agent(f"r{i}", model="smollm2", prompt=[doc, f"Review {aspect}"]) for i, aspect in ...]
    meta = wf.agent("meta", model="smollm2", prompt=[doc, *revs, "Summarize"], max_tokens=64)

Prompt parts are strings, contexts, other agents (their output text), or KV operator nodes.
A context may be given as token ids (`wf.context("doc", token_ids=ids)`), and an agent marked
`rendered=True` takes its prompt as already rendered: no chat template, parts joined as they are
(`aaflow serve` gives each request's whole tokenized chat that way).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, Union

from aaflow.common.errors import WorkflowError
from aaflow.common.strategies import STRATEGIES
from aaflow.workflow.checks import check_agent_settings, check_rendered, check_unicode, checked_history, checked_ids


@dataclass(frozen=True)
class ContextNode:
    """A static document or instruction every agent that names it reads: its `text`, or its
    `token_ids` in the model's vocabulary (already tokenized; the other field is None)."""

    name: str
    text: str | None
    token_ids: tuple[int, ...] | None = None


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
        rendered: the prompt is already rendered (a chat template applied, e.g. token-id contexts
            of a whole tokenized chat): no chat frame, no system or history, parts joined with no
            separator; its leading contexts short of its last part are its shareable prefix.
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
    rendered: bool = False

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

    def context(self, name: str, text: str | None = None, *, token_ids=None) -> Ref:
        """A static context (document, guide, shared instructions): its `text`, or its `token_ids`
        (a non-empty list of ids of the model's tokenizer, read as they are)."""
        if token_ids is not None:
            if text is not None:
                raise WorkflowError(f"context {name!r}: give text or token_ids, not both")
            return self._add(ContextNode(name, None, checked_ids(name, token_ids)), "context")
        if not isinstance(text, str) or not text:
            raise WorkflowError(f"context {name!r}: text must be a non-empty string, got {text!r:.40}")
        check_unicode(f"context {name!r}", text)
        return self._add(ContextNode(name, text), "context")

    def agent(self, name: str, model: str, prompt: list, system: str | None = None, max_tokens: int = 64,
              temperature: float = 0.0, top_p: float = 1.0, seed: int | None = None, unordered: bool = False,
              strategy: str | None = None, ignore_eos: bool = False, history=(), rendered: bool = False) -> Ref:
        """An agent; `prompt` parts are strings or the handles returned by context/agent/kv-op calls;
        `history` earlier turns of its conversation (`{"role", "content"}` dicts or pairs, role
        "user" or "assistant"), rendered by the model's chat template before this turn.
        `rendered=True`: the prompt is already rendered (see `AgentNode.rendered`); it must start
        with a context (its shareable prefix) and have another part after it."""
        parts = tuple(self._part(name, p) for p in (prompt if isinstance(prompt, (list, tuple)) else [prompt]))
        if not parts:
            raise WorkflowError(f"agent {name!r}: the prompt is empty")
        check_agent_settings(name, model, system, max_tokens, temperature, top_p, seed, unordered, ignore_eos)
        if strategy is not None and strategy not in STRATEGIES:
            raise WorkflowError(f"agent {name!r}: unknown strategy {strategy!r}; choose one of {STRATEGIES}")
        history = checked_history(name, history)
        if rendered is not False:
            check_rendered(name, rendered, system, history, parts)
        node = AgentNode(name, model, parts, system, max_tokens, temperature, top_p, seed, unordered, strategy,
                         ignore_eos, history, rendered)
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
            check_unicode(f"node {owner!r}", part)
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

