"""aaflow: a distributed KV-state workflow runtime for multi-agent LLM systems.

This module is a thin facade: names are imported lazily on first use so that
`import aaflow` stays cheap and creates no import cycles.

Layer: front end.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_EXPORTS = {
    "Engine": "aaflow.engine",
    "GenerationOutput": "aaflow.engine",
    "KVExport": "aaflow.engine",
    "fetch_model": "aaflow.models",
    "AAFlowError": "aaflow.common.errors",
    "ModelNotFoundError": "aaflow.common.errors",
    "ModelFetchError": "aaflow.common.errors",
    "UnsupportedModelError": "aaflow.common.errors",
    "PromptError": "aaflow.common.errors",
    "SamplingError": "aaflow.common.errors",
    "SequenceError": "aaflow.common.errors",
    "InvalidArgumentError": "aaflow.common.errors",
    "KVCapacityError": "aaflow.common.errors",
    "KVImportError": "aaflow.common.errors",
    "ModelMismatchError": "aaflow.common.errors",
    "KVTransferError": "aaflow.common.errors",
    "WorkflowError": "aaflow.common.errors",
    "KVRefFreedError": "aaflow.common.errors",
    "KVEvictedError": "aaflow.common.errors",
    "KVLocationError": "aaflow.common.errors",
    "KVComposeError": "aaflow.common.errors",
    "Workflow": "aaflow.workflow",
    "run": "aaflow.running",
    "start": "aaflow.running",
    "RunHandle": "aaflow.runtime",
    "RunCancelledError": "aaflow.runtime",
    "RunResult": "aaflow.runtime",
    "AgentFailedError": "aaflow.runtime",
    "init": "aaflow.cluster.cluster",
    "Cluster": "aaflow.cluster.cluster",
    "ClusterError": "aaflow.cluster.cluster",
    "load_workflow": "aaflow.workflow_files",
    "save_workflow": "aaflow.workflow_files",
    "KVSpec": "aaflow.operators",
    "KVRef": "aaflow.operators",
    "KVHost": "aaflow.operators",
    "EvictionPolicy": "aaflow.operators",
    "FidelityReport": "aaflow.operators",
    "materialize": "aaflow.api",
    "transfer": "aaflow.api",
    "fork": "aaflow.api",
    "compose": "aaflow.api",
    "evict": "aaflow.api",
    "free": "aaflow.api",
    "pin": "aaflow.api",
    "unpin": "aaflow.api",
    "generate": "aaflow.api",
    "extend": "aaflow.operators",
    "plan": "aaflow.cluster.planning",
    "plan_load": "aaflow.cluster.planning.load",
    "LoadPrediction": "aaflow.cluster.planning.load",
    "calibrate": "aaflow.cluster.calibration",
    "CostModelError": "aaflow.common.errors",
    "DeploymentError": "aaflow.common.errors",
    "up": "aaflow.cluster.deployment",
    "connect": "aaflow.cluster.deployment",
    "down": "aaflow.cluster.deployment",
    "status": "aaflow.cluster.deployment",
    "submit": "aaflow.submission",
    "HardwareProfile": "aaflow.costmodel.hardware",
    "load_hardware": "aaflow.costmodel.hardware",
}

__all__ = sorted(_EXPORTS) + ["__version__"]


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'aaflow' has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return __all__
