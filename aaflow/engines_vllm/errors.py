"""Errors of the vLLM backend. Importable without vLLM installed."""

from __future__ import annotations

from aaflow.common.errors import AAFlowError, KVImportError

SETUP_HINT = "bash scripts/setup_vllm_env.sh"


class VLLMUnavailableError(AAFlowError, RuntimeError):
    """vLLM is not installed where aaflow looks for it, or its engine failed to start or died.

    The message says what was found and names the fix (`bash scripts/setup_vllm_env.sh`, or
    AAFLOW_VLLM_PYTHON pointing at a Python that can `import vllm`).
    """


class VLLMKVLayoutError(KVImportError):
    """vLLM's paged KV cache layout cannot be converted to or from aaflow's KV export layout."""


class VLLMUnsupportedError(AAFlowError, NotImplementedError):
    """An operation aaflow does not support on a vLLM replica (e.g. compose, approximate KV, a
    transport other than "ray"); the message says what to do instead."""
