"""What the explicit KV operator nodes of a workflow ask of the scheduler.

A prompt part that is a `fork`, `compose` or `transfer` node reads as the contexts and agent
outputs it carries (see `prompts.prompt_leaves`); in addition:
  fork / compose  the agent's static prefix is shared as KV (materialized once, forked per agent,
                  transferred to other replicas) under every strategy except the `text` baseline;
  transfer        the same, and the agent runs on the replica named by `replica=` when it is alive;
  compose         with mode="rerotate" or "blend" (and r, blend's recompute fraction), the
                  contexts at the start of the prompt are materialized separately (each served by
                  the prefix cache wherever it was computed before) and their KV composed:
                  approximate, reported in the agent's `fidelity`; mode="exact" (the default) is
                  the plain shared prefix, computed as one;
  evict           the shared KV of every prefix containing the named contexts is evicted
                  (`aaflow.operators.evict`: its blocks leave the pool, the ref stays and a later fork
                  rebuilds it from lineage) as soon as all the agents sharing it have forked it;
                  it is freed once no pending agent reads it.
"""

from __future__ import annotations

from dataclasses import dataclass

from aaflow.common.errors import WorkflowError
from aaflow.workflow.graph import AgentNode, KVOpNode, Ref, Workflow

SHARING_OPS = ("fork", "compose", "transfer")
COMPOSE_MODES = ("exact", "rerotate", "blend")
DEFAULT_BLEND_R = 0.15  # blend's recompute fraction unless the node names one


@dataclass(frozen=True)
class KVDirective:
    """The KV operator nodes in one agent's prompt, summarized."""

    share_prefix: bool = False  # a fork / compose / transfer node appears in the prompt
    replica: str | None = None  # a transfer node's destination replica
    compose: tuple[str, float] | None = None  # (mode, r) of an approximate compose node


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
    composes = {compose_mode(op) for op in ops if op.op == "compose"} - {None}
    if len(composes) > 1:
        raise WorkflowError(f"agent {agent.name!r}: its compose nodes ask for different modes {sorted(composes)}")
    return KVDirective(any(op.op in SHARING_OPS for op in ops), next(iter(replicas), None), next(iter(composes), None))


def compose_mode(op: KVOpNode) -> tuple[str, float] | None:
    """(mode, r) of a compose node that composes approximately; None for an exact one."""
    options = dict(op.options)
    mode = options.get("mode", "exact")
    if mode not in COMPOSE_MODES:
        raise WorkflowError(f"compose node {op.name!r}: unknown mode {mode!r}; choose one of {COMPOSE_MODES}")
    try:
        r = float(options.get("r", DEFAULT_BLEND_R))
    except ValueError:
        raise WorkflowError(f"compose node {op.name!r}: r must be a number in [0, 1], got {options['r']!r}") from None
    if not 0 <= r <= 1:
        raise WorkflowError(f"compose node {op.name!r}: r must be a number in [0, 1], got {r}")
    return None if mode == "exact" else (mode, r)


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
