"""Workflows as YAML (`aaflow/configs/workflows/*.yaml`) for `aaflow run` and `aaflow plan`.

    name: review
    contexts:
      paper: {file: paper.txt}        # or an inline string, or {token_ids: [...]} (already tokenized)
    agents:
      r1: {model: smollm2, prompt: [{ref: paper}, "Review the method."], max_tokens: 64}
      meta: {model: smollm2, prompt: [{ref: paper}, {ref: r1}, "Summarize."]}
    kv_ops:                           # optional explicit KV operator nodes
      shared: {op: fork, inputs: [paper]}     # then {ref: shared} in a prompt

An agent with `rendered: true` takes its prompt as already rendered (`Workflow.agent`).
Unknown keys are rejected with the key named; references may point forward (order is resolved).
`save_workflow` writes a workflow built in Python as such a file (contexts inline).
"""

from __future__ import annotations

from pathlib import Path

import yaml

from aaflow.common.errors import WorkflowError
from aaflow.workflow.graph import AgentNode, ContextNode, KVOpNode, Ref, Workflow

_TOP_KEYS = {"name", "contexts", "agents", "kv_ops"}
_KVOP_KEYS = {"op", "inputs", "replica", "mode", "r"}
_AGENT_KEYS = {"model", "prompt", "system", "max_tokens", "temperature", "top_p", "seed", "unordered", "strategy",
               "ignore_eos", "history", "rendered"}


def _unknown(where: str, given: dict, allowed: set[str]) -> None:
    extra = sorted(set(given) - allowed, key=repr)  # YAML keys may be numbers, booleans or null
    if extra:
        raise WorkflowError(f"{where}: unknown key {extra[0]!r} (allowed: {', '.join(sorted(allowed))})")


def workflow_from_dict(raw: dict, base_dir: Path | None = None) -> Workflow:
    """Build and validate a `Workflow` from its YAML mapping."""
    if not isinstance(raw, dict):
        raise WorkflowError("a workflow YAML must be a mapping with name, contexts and agents")
    _unknown("workflow", raw, _TOP_KEYS)
    wf = Workflow(str(raw.get("name") or "workflow"))
    contexts = raw.get("contexts") or {}
    if not isinstance(contexts, dict):
        raise WorkflowError("contexts must be a mapping of context name -> text or {file: path}")
    for name, value in contexts.items():
        if isinstance(value, dict):
            _unknown(f"context {name!r}", value, {"file", "text", "token_ids"})
            if "token_ids" in value:
                if len(value) > 1:
                    raise WorkflowError(f"context {name!r}: give token_ids alone, without text or file")
                wf.context(name, token_ids=value["token_ids"])
                continue
            value = _read_context_file(name, value["file"], base_dir) if "file" in value else value.get("text", "")
        wf.context(name, value)
    agents = raw.get("agents") or {}
    if not isinstance(agents, dict):
        raise WorkflowError("agents must be a mapping of agent name -> settings")
    for name, spec in agents.items():
        if not isinstance(spec, dict):
            raise WorkflowError(f"agent {name!r}: settings must be a mapping")
        _unknown(f"agent {name!r}", spec, _AGENT_KEYS)
        if "model" not in spec or "prompt" not in spec:
            raise WorkflowError(f"agent {name!r}: model and prompt are required")
    ops = raw.get("kv_ops") or {}
    if not isinstance(ops, dict):
        raise WorkflowError("kv_ops must be a mapping of node name -> {op, inputs, ...}")
    for name, spec in ops.items():
        if not isinstance(spec, dict) or "op" not in spec:
            raise WorkflowError(f"kv op {name!r}: settings must be a mapping with op and inputs")
        _unknown(f"kv op {name!r}", spec, _KVOP_KEYS)
    refs = {n: _refs(n, s["prompt"]) for n, s in agents.items()}
    refs.update({n: _input_names(n, s.get("inputs")) for n, s in ops.items()})
    placed: set[str] = set(wf.nodes)
    pending = {**{n: ("agent", s) for n, s in agents.items()}, **{n: ("kvop", s) for n, s in ops.items()}}
    while pending:
        ready = [n for n in pending if all(r in placed for r in refs[n])]
        if not ready:
            missing = {r for n in pending for r in refs[n]} - placed - set(pending)
            if missing:
                name = next(n for n in pending if set(refs[n]) & missing)
                raise WorkflowError(f"node {name!r} refers to unknown node {sorted(missing)[0]!r}")
            raise WorkflowError(f"workflow {wf.name!r} has a cycle among nodes {sorted(pending)}")
        for name in ready:
            kind, spec = pending.pop(name)
            spec = dict(spec)
            if kind == "kvop":
                spec.pop("inputs", None)  # given as the handles, not as an option
                wf.kv_op(name, spec.pop("op"), *(_ref(wf, i) for i in refs[name]), **spec)
            else:
                parts = [_ref(wf, p["ref"]) if isinstance(p, dict) else p for p in _as_list(spec.pop("prompt"))]
                wf.agent(name, spec.pop("model"), parts, **spec)
            placed.add(name)
    wf.validate()
    return wf


def _read_context_file(name, file, base_dir: Path | None) -> str:
    """The text of a context's file (relative to the workflow file); `WorkflowError` if it cannot be read."""
    if not isinstance(file, str) or not file:
        raise WorkflowError(f"context {name!r}: file must be a path string, got {file!r}")
    path = Path(file)
    path = path if path.is_absolute() or base_dir is None else base_dir / path
    if not path.is_file():
        raise WorkflowError(f"context {name!r}: file {path} does not exist or is not a file")
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise WorkflowError(f"context {name!r}: cannot read {path} as UTF-8 text ({exc})") from exc


def _ref(wf: Workflow, name: str) -> Ref:
    node = wf.nodes[name]
    kind = {"ContextNode": "context", "AgentNode": "agent", "KVOpNode": "kvop"}[type(node).__name__]
    return Ref(name, kind)  # type: ignore[arg-type]


def _input_names(op: str, inputs) -> list[str]:
    names = _as_list(inputs if inputs is not None else [])
    if not all(isinstance(i, str) for i in names):
        raise WorkflowError(f"kv op {op!r}: inputs must be a list of node names, got {inputs!r}")
    return names


def _as_list(prompt) -> list:
    return prompt if isinstance(prompt, list) else [prompt]


def _refs(agent: str, prompt) -> list[str]:
    refs = []
    for part in _as_list(prompt):
        if isinstance(part, dict):
            _unknown(f"agent {agent!r} prompt part", part, {"ref"})
            if not isinstance(part.get("ref"), str):
                raise WorkflowError(f"agent {agent!r}: a prompt reference must be {{ref: node name}}, got {part!r}")
            refs.append(part["ref"])
        elif not isinstance(part, str):
            raise WorkflowError(f"agent {agent!r}: prompt parts must be strings or {{ref: name}}, got {part!r}")
    return refs


def load_workflow(path: str | Path) -> Workflow:
    """Read a workflow YAML file (context files are resolved next to it)."""
    path = Path(path)
    if not path.exists():
        raise WorkflowError(f"workflow file {path} does not exist")
    try:
        raw = yaml.safe_load(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError) as exc:
        raise WorkflowError(f"cannot read {path} as UTF-8 text: {exc}") from exc
    except (yaml.YAMLError, RecursionError) as exc:
        raise WorkflowError(f"{path} is not valid YAML: {exc}") from exc
    return workflow_from_dict(raw, base_dir=path.parent)


def workflow_to_dict(wf: Workflow) -> dict:
    """The YAML mapping of `wf` (contexts inline, agent settings only where they differ from the
    defaults): `workflow_from_dict` of it builds the same workflow."""
    defaults = AgentNode("", "", ())
    out: dict = {"name": wf.name, "contexts": {}, "agents": {}, "kv_ops": {}}
    for name, node in wf.nodes.items():
        if isinstance(node, ContextNode):
            content = {"text": node.text} if node.token_ids is None else {"token_ids": list(node.token_ids)}
            out["contexts"][name] = content
        elif isinstance(node, KVOpNode):
            out["kv_ops"][name] = {"op": node.op, "inputs": list(node.inputs), **dict(node.options)}
        else:
            spec = {"model": node.model, "prompt": [p if isinstance(p, str) else {"ref": p.name} for p in node.prompt]}
            for key in sorted(_AGENT_KEYS - {"model", "prompt"}):
                value = getattr(node, key)
                if value != getattr(defaults, key):
                    spec[key] = [list(turn) for turn in value] if key == "history" else value
            out["agents"][name] = spec
    return {k: v for k, v in out.items() if v}


def save_workflow(wf: Workflow, path: str | Path) -> Path:
    """Write `wf` as a workflow YAML file that `load_workflow` reads back as the same workflow."""
    path = Path(path)
    path.write_text(yaml.safe_dump(workflow_to_dict(wf), sort_keys=False, allow_unicode=True), encoding="utf-8")
    return path
