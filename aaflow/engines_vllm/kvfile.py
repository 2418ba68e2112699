"""aaflow's KV export as a file: how KV crosses between the aaflow process and a vLLM process.

One safetensors file per export: tensor "kv" [num_layers, 2 (k, v), n, num_kv_heads, head_dim]
(the layout of `aaflow.engine.KVExport.kv`), metadata "fingerprint" and "token_ids" (JSON).
Needs only torch and safetensors, so both Python environments (aaflow's and vLLM's) import it.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file


@dataclass(frozen=True)
class KVFileHeader:
    """What a KV file holds, read without loading the tensor."""

    fingerprint: str
    token_ids: tuple[int, ...]
    shape: tuple[int, ...]  # [num_layers, 2, n, num_kv_heads, head_dim]
    dtype: str  # safetensors dtype name, e.g. "BF16"


_DTYPE_NAMES = {torch.bfloat16: "BF16", torch.float16: "F16", torch.float32: "F32"}


def dtype_name(dtype: torch.dtype) -> str:
    return _DTYPE_NAMES.get(dtype, str(dtype))


def write_kv_file(path: str | os.PathLike, fingerprint: str, token_ids, kv: torch.Tensor) -> None:
    """kv: [num_layers, 2, n, num_kv_heads, head_dim] with n == len(token_ids); written atomically."""
    ids = [int(t) for t in token_ids]
    if kv.dim() != 5 or kv.shape[1] != 2 or kv.shape[2] != len(ids):
        raise ValueError(f"KV shape {tuple(kv.shape)} is not [layers, 2, {len(ids)}, kv_heads, head_dim]")
    tmp = Path(f"{path}.tmp")
    save_file({"kv": kv.contiguous()}, str(tmp),
              metadata={"fingerprint": fingerprint, "token_ids": json.dumps(ids)})
    os.replace(tmp, path)


def read_kv_header(path: str | os.PathLike) -> KVFileHeader:
    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata() or {}
        sl = f.get_slice("kv")
        shape, dtype = tuple(sl.get_shape()), sl.get_dtype()
    return KVFileHeader(meta.get("fingerprint", ""), tuple(json.loads(meta.get("token_ids", "[]"))), shape, dtype)


def read_kv_file(path: str | os.PathLike) -> tuple[KVFileHeader, torch.Tensor]:
    """The header and the KV tensor [num_layers, 2, n, num_kv_heads, head_dim]."""
    header = read_kv_header(path)
    with safe_open(str(path), framework="pt") as f:
        kv = f.get_tensor("kv")
    return header, kv
