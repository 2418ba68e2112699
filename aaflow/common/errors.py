"""The domain exceptions of aaflow. Each says what was wrong and what to do about it."""

from __future__ import annotations


class AAFlowError(Exception):
    """Base class of every error aaflow raises on purpose."""


class ModelNotFoundError(AAFlowError, LookupError):
    """A model name is not in the registry, or a model folder is missing or incomplete."""


class ModelFetchError(AAFlowError, RuntimeError):
    """Downloading or converting a registered model's weights failed."""


class UnsupportedModelError(AAFlowError, ValueError):
    """The model's architecture or RoPE scaling is not one the built-in engine implements."""


class PromptError(AAFlowError, ValueError):
    """A prompt is empty, malformed, or longer than the model's positions."""


class SamplingError(AAFlowError, ValueError):
    """A sampling parameter (temperature, top_p, max_new_tokens, ...) is out of range."""


class InvalidArgumentError(AAFlowError, ValueError, TypeError):
    """An operator argument has the wrong type or is out of range (a fork count, a chunk size, a TTL,
    something that is not a KVRef); the message names the argument, what was given and what is expected."""


class SequenceError(AAFlowError, KeyError):
    """A sequence id is unknown to the engine (never created, or already freed)."""

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0]) if self.args else ""


class KVCapacityError(AAFlowError, MemoryError):
    """The KV block pool has too few free blocks for a request.

    Attributes:
        needed_blocks: blocks the request needs.
        free_blocks: blocks that were free (including evictable cached blocks).
    """

    def __init__(self, needed_blocks: int, free_blocks: int, hint: str = "") -> None:
        self.needed_blocks = needed_blocks
        self.free_blocks = free_blocks
        self.hint = hint
        msg = (
            f"KV pool exhausted: need {needed_blocks} blocks, {free_blocks} free. "
            "Free finished sequences, or create the engine with a larger "
            "kv_cache_bytes / num_blocks."
        )
        super().__init__(msg + (f" {hint}" if hint else ""))

    def __reduce__(self):  # crosses process boundaries (Ray) intact
        return (type(self), (self.needed_blocks, self.free_blocks, self.hint))


class KVImportError(AAFlowError, ValueError):
    """Imported KV does not match this engine (fingerprint, shape or dtype)."""


class ModelMismatchError(AAFlowError, ValueError):
    """KV made by one model was offered to a replica serving a different model."""


class KVTransferError(AAFlowError, RuntimeError):
    """A KV transfer failed or timed out; both sides' pools are left consistent."""


class WorkflowError(AAFlowError, ValueError):
    """A workflow graph is invalid (cycle, unknown reference, unserved model, ...)."""


class KVRefFreedError(AAFlowError, LookupError):
    """A KVRef was used after it was explicitly freed."""


class KVEvictedError(AAFlowError, LookupError):
    """An evicted KVRef cannot be rebuilt: it was made without lineage and was not spilled."""


class KVLocationError(AAFlowError, ValueError):
    """KVRefs on different engines/replicas were combined without transferring them first."""


class KVComposeError(AAFlowError, ValueError):
    """KV parts cannot be composed in the requested mode (e.g. exact compose of independent parts)."""


class CostModelError(AAFlowError, ValueError):
    """A cost-model input is invalid: a unit string, a hardware profile, or a model with no timing data."""


class DeploymentError(AAFlowError, RuntimeError):
    """No aaflow deployment where one was asked for (or one already there for `aaflow up`)."""
