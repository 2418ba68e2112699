"""Shared by the deployment tests (test_deployment.py, test_deployment_readme.py): the document their
workflows read, a workflow file over it, and how many of its prompt tokens fill whole KV blocks."""

from __future__ import annotations

import json

DOC = ("Paged attention stores the KV cache in fixed-size blocks, so that sequences share blocks "
       "copy-on-write and a prefix computed once serves every later request that starts with it. ") * 2


def workflow_yaml(folder, name: str, model: str, agents: dict[str, str], doc: str = DOC) -> str:
    (folder / "doc.txt").write_text(doc)
    lines = [f"name: {name}", "contexts:", "  doc: {file: doc.txt}", "agents:"]
    for agent, question in agents.items():
        lines.append(f"  {agent}: {{model: {json.dumps(model)}, prompt: [{{ref: doc}}, {json.dumps(question)}], "
                     "max_tokens: 8, ignore_eos: true}")
    path = folder / f"{name}.yaml"
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def doc_blocks_tokens(model: str, doc: str = DOC, block: int = 16) -> int:
    from aaflow.cluster.pins import prompt_prefix

    return len(prompt_prefix(model, doc)) // block * block
