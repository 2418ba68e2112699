"""What the explicit KV operator nodes of a workflow ask of the executor.

A prompt part that is a `fork`, `compose` or `transfer` node reads as the contexts and agent
outputs it carries (see `prompts.prompt_leaves`); in addition:
  fork / compose  the agent's static prefix is shared as KV (materialized once, forked per agent,
                  transferred to other replicas) under every strategy except the `text` baseline;
  transfer        the same, and the agent runs on the replica named by `replica=` when it is alive;
  evict           the shared KV of every prefix containing the named contexts is freed as soon as
                  all the agents sharing it have forked it, instead of at the end of the run.
"""

from __future__ import annotations

from dataclasses import dataclass

from aaflow.errors import WorkflowError
from aaflow.workflow.graph import AgentNode, KVOpNode, Ref, Workflow

SHARING_OPS = ("fork", "compose", "transfer")


@dataclass(frozen=True)
class KVDirective:
    """The KV operator nodes in one agent's prompt, summarized."""

    share_prefix: bool = False  # a fork / compose / transfer node appears in the prompt
    replica: str | None = None  # a transfer node's destination replica


def _ops_in_prompt(wf: Workflow, agent: AgentNode) -> list[KVOpNode]:
    found: list[KVOpNode] = []

    def visit(name: str) -> None:
        node = wf.nodes[name]
        if isinstance(node, KVOpNode):
            found.append(node)
            for inner in node.inputs:
                visit(inner)

    for part in agent.prompt:
        if isinstance(part, Ref):
            visit(part.name)
    return found


def directive(wf: Workflow, agent: AgentNode) -> KVDirective:
    """What the agent's KV operator nodes ask for."""
    ops = _ops_in_prompt(wf, agent)
    replicas = {dict(op.options).get("replica") for op in ops if op.op == "transfer"} - {None}
    if len(replicas) > 1:
        raise WorkflowError(f"agent {agent.name!r}: its transfer nodes name different replicas {sorted(replicas)}")
    return KVDirective(any(op.op in SHARING_OPS for op in ops), next(iter(replicas), None))


def evicted_contexts(wf: Workflow) -> set[str]:
    """Contexts named (directly or through other KV nodes) by evict nodes."""
    names: set[str] = set()

    def leaves(name: str) -> None:
        node = wf.nodes[name]
        if isinstance(node, KVOpNode):
            for inner in node.inputs:
                leaves(inner)
        elif not isinstance(node, AgentNode):
            names.add(name)

    for node in wf.nodes.values():
        if isinstance(node, KVOpNode) and node.op == "evict":
            for name in node.inputs:
                leaves(name)
    return names


def check_replicas(wf: Workflow, replica_names: set[str]) -> None:
    """Transfer nodes must name a replica of the cluster."""
    for node in wf.nodes.values():
        target = dict(node.options).get("replica") if isinstance(node, KVOpNode) else None
        if target is not None and target not in replica_names:
            raise WorkflowError(f"kv op {node.name!r}: replica {target!r} is not in the cluster "
                                f"(replicas: {sorted(replica_names)})")
