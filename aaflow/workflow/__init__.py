"""The workflow DSL: the graph (`graph`, which the core runtime runs) and its YAML form (`yaml_io`).

Names are imported on first use, so that the core, which imports `aaflow.workflow.graph`, does not
load the YAML reader."""

import importlib

_EXPORTS = {"AgentNode": "graph", "ContextNode": "graph", "KVOpNode": "graph", "Ref": "graph", "Workflow": "graph",
            "load_workflow": "yaml_io", "save_workflow": "yaml_io", "workflow_from_dict": "yaml_io",
            "workflow_to_dict": "yaml_io"}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'aaflow.workflow' has no attribute {name!r}")
    return getattr(importlib.import_module(f"aaflow.workflow.{_EXPORTS[name]}"), name)
