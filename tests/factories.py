"""Factories for test models (they live in `aaflow.models.tiny`, which the fuzz and soak benchmarks share)."""

from aaflow.models.tiny import TINY_VOCAB, make_tiny_model, save_byte_tokenizer, tiny_config

__all__ = ["TINY_VOCAB", "make_tiny_model", "save_byte_tokenizer", "tiny_config"]
