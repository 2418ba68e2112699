"""vLLM as an aaflow engine backend: `VLLMEngine` and the `AAFlowConnector` KV connector.

Importing this package needs neither vLLM nor a running vLLM: vLLM lives in its own Python
environment (`bash scripts/setup_vllm_env.sh`) and is started as a child process by
`VLLMEngine.from_pretrained`, which raises `VLLMUnavailableError` naming that fix when it cannot.

Layer: core.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "VLLMEngine": "aaflow.engines_vllm.engine",
    "VLLMUnavailableError": "aaflow.engines_vllm.errors",
    "VLLMKVLayoutError": "aaflow.engines_vllm.errors",
    "VLLMUnsupportedError": "aaflow.engines_vllm.errors",
    "check_vllm": "aaflow.engines_vllm.process",
    "vllm_python": "aaflow.engines_vllm.process",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'aaflow.engines_vllm' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
