"""The disk tier: evicted KV written as safetensors and checked again before it is reloaded."""

from __future__ import annotations

import json
from pathlib import Path

from safetensors import safe_open
from safetensors.torch import save_file

from aaflow.common.errors import KVImportError
from aaflow.operators.payload import KVPayload


def spill_export(export, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    meta = {"fingerprint": export.fingerprint, "token_ids": json.dumps(list(export.token_ids))}
    save_file({"kv": export.kv.contiguous()}, str(path), metadata=meta)
    return path


def load_spilled(path: Path, fingerprint: str) -> KVPayload:
    """Read a spilled KV file; the fingerprint is checked before the tensor is read. A damaged or
    foreign file raises `KVImportError` (the ref is then rebuilt from lineage or must be recomputed)."""
    try:
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
            if meta.get("fingerprint") != fingerprint:
                raise KVImportError(f"{path}: spilled KV belongs to another model; it cannot be reloaded here")
            kv = f.get_tensor("kv")
        token_ids = json.loads(meta["token_ids"])
    except KVImportError:
        raise
    except Exception as exc:  # noqa: BLE001 - safetensors and json raise several untyped errors on damage
        raise KVImportError(f"{path} is not a readable spilled KV file ({exc!r}); recompute the context") from exc
    if not isinstance(token_ids, list):
        raise KVImportError(f"{path}: token_ids metadata is not a list; recompute the context")
    return KVPayload(meta["fingerprint"], tuple(token_ids), kv)
