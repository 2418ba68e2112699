"""Model fingerprints: KV is only meaningful on the exact model (weights, dtype, RoPE) that made it."""

from __future__ import annotations

import hashlib
from dataclasses import asdict
from pathlib import Path

import torch

from aaflow.engine.config import ModelConfig

_CHUNK = 16 * 2**20


def weights_digest(folder: Path) -> str:
    """sha256 over every safetensors file of a model folder, in name order."""
    h = hashlib.sha256()
    for f in sorted(Path(folder).glob("*.safetensors")):
        h.update(f.name.encode())
        with f.open("rb") as fh:
            while chunk := fh.read(_CHUNK):
                h.update(chunk)
    return h.hexdigest()


def model_fingerprint(config: ModelConfig, dtype: torch.dtype, weights_sha256: str) -> str:
    """One hex string naming architecture + shapes + RoPE + dtype + weights."""
    h = hashlib.sha256()
    h.update(repr(sorted(asdict(config).items())).encode())
    h.update(str(dtype).encode())
    h.update(weights_sha256.encode())
    return h.hexdigest()
