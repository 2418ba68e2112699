"""aaflow: a distributed KV-state workflow runtime for multi-agent LLM systems.

This module is a thin facade: names are imported lazily on first use so that
`import aaflow` stays cheap and creates no import cycles.
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
    "AAFlowError": "aaflow.errors",
    "ModelNotFoundError": "aaflow.errors",
    "ModelFetchError": "aaflow.errors",
    "UnsupportedModelError": "aaflow.errors",
    "PromptError": "aaflow.errors",
    "SamplingError": "aaflow.errors",
    "SequenceError": "aaflow.errors",
    "InvalidArgumentError": "aaflow.errors",
    "KVCapacityError": "aaflow.errors",
    "KVImportError": "aaflow.errors",
    "ModelMismatchError": "aaflow.errors",
    "KVTransferError": "aaflow.errors",
    "WorkflowError": "aaflow.errors",
    "KVRefFreedError": "aaflow.errors",
    "KVEvictedError": "aaflow.errors",
    "KVLocationError": "aaflow.errors",
    "KVComposeError": "aaflow.errors",
    "Workflow": "aaflow.workflow",
    "run": "aaflow.running",
    "start": "aaflow.running",
    "RunHandle": "aaflow.runtime",
    "RunCancelledError": "aaflow.runtime",
    "RunResult": "aaflow.runtime",
    "AgentFailedError": "aaflow.runtime",
    "init": "cluster.cluster",
    "Cluster": "cluster.cluster",
    "ClusterError": "cluster.cluster",
    "load_workflow": "aaflow.workflow",
    "save_workflow": "aaflow.workflow",
    "KVSpec": "operators",
    "KVRef": "operators",
    "KVHost": "operators",
    "EvictionPolicy": "operators",
    "FidelityReport": "operators",
    "materialize": "aaflow.api",
    "transfer": "aaflow.api",
    "fork": "aaflow.api",
    "compose": "aaflow.api",
    "evict": "aaflow.api",
    "free": "aaflow.api",
    "pin": "aaflow.api",
    "unpin": "aaflow.api",
    "generate": "aaflow.api",
    "extend": "operators",
    "plan": "aaflow.planning",
    "plan_load": "aaflow.planning.load",
    "LoadPrediction": "aaflow.planning.load",
    "calibrate": "aaflow.calibration",
    "CostModelError": "aaflow.errors",
    "DeploymentError": "aaflow.errors",
    "up": "cluster.deployment",
    "connect": "cluster.deployment",
    "down": "cluster.deployment",
    "status": "cluster.deployment",
    "submit": "aaflow.submission",
    "HardwareProfile": "costmodel.hardware",
    "load_hardware": "costmodel.hardware",
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
