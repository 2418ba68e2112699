"""The workflow graph the runtime runs (the DSL's `Workflow`, its nodes and their checks). Layer: core.

Its YAML form, a front-end concern, is `aaflow.workflow_files`."""

from aaflow.workflow.graph import AgentNode, ContextNode, KVOpNode, Ref, Workflow

__all__ = ["AgentNode", "ContextNode", "KVOpNode", "Ref", "Workflow"]
