"""Random-weight models: a real model's architecture and tokenizer with some config values changed.

Used to time a larger downstream model (for example SmolLM2-360M's shape) where no real weights
can be fetched here. The weights are drawn from the architecture's own initializer with a fixed
seed, so the same entry always gives the same weights (and the same model fingerprint). Its
text is meaningless; benchmarks label it as such.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import transformers
from transformers import AutoConfig, AutoTokenizer


def make_random_model(base: Path, out: Path, overrides: dict, seed: int, save_dtype: str) -> None:
    """Write an HF folder to `out`: `base`'s config.json with `overrides` applied, random weights
    (seeded), and `base`'s tokenizer."""
    config_dict = json.loads((base / "config.json").read_text())
    unknown = sorted(k for k in overrides if k not in config_dict)
    if unknown:
        raise ValueError(f"config keys {unknown} are not in {base / 'config.json'}; known: {sorted(config_dict)}")
    config = AutoConfig.from_pretrained(base)
    for key, value in overrides.items():
        setattr(config, key, value)
    config.dtype = save_dtype
    model_cls = getattr(transformers, config.architectures[0])
    torch.manual_seed(seed)
    model = model_cls(config).to(getattr(torch, save_dtype))
    model.save_pretrained(out, safe_serialization=True)
    AutoTokenizer.from_pretrained(base).save_pretrained(out)
