"""The built-in engine: Llama-family models on a paged KV block pool (no Ray, no operators). Layer: core."""

from aaflow.engine.block_manager import BlockStats
from aaflow.engine.config import ModelConfig
from aaflow.engine.engine import Engine
from aaflow.engine.kv_cache import KVLayout
from aaflow.engine.outputs import GenerationOutput
from aaflow.engine.sampling import SamplingParams
from aaflow.engine.sequence import KVExport

__all__ = ["BlockStats", "Engine", "GenerationOutput", "KVExport", "KVLayout", "ModelConfig", "SamplingParams"]
