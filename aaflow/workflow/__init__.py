"""The workflow DSL (Python and YAML)."""

from aaflow.workflow.graph import AgentNode, ContextNode, KVOpNode, Ref, Workflow
from aaflow.workflow.yaml_io import load_workflow, workflow_from_dict

__all__ = ["AgentNode", "ContextNode", "KVOpNode", "Ref", "Workflow", "load_workflow", "workflow_from_dict"]
