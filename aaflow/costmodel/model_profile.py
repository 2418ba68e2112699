"""What the cost model needs to know about a model: KV bytes per token, FLOPs per token, weight bytes."""

from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass
from pathlib import Path

from aaflow.common.errors import CostModelError

DTYPE_BYTES = {"float32": 4, "fp32": 4, "bfloat16": 2, "bf16": 2, "float16": 2, "fp16": 2, "half": 2,
               "float8_e4m3fn": 1, "float8_e5m2": 1, "fp8": 1, "int8": 1}


def dtype_bytes(dtype: str) -> int:
    """Bytes per element of a dtype name ("bfloat16" -> 2)."""
    try:
        return DTYPE_BYTES[dtype]
    except KeyError:
        raise CostModelError(f"unknown dtype {dtype!r}; choose one of {sorted(DTYPE_BYTES)}") from None


@dataclass(frozen=True)
class ModelProfile:
    """The shape of a dense decoder-only transformer, as far as timing and KV size go.

    Attributes:
        name: the model's short name (the key of its compute entry in a hardware profile).
        layers: decoder layers.
        kv_heads: key/value heads (GQA groups).
        head_dim: dimension of one head.
        num_heads: query heads.
        params: parameter count (embeddings and lm_head included).
        dtype_bytes: bytes per weight and per KV element (2 for bf16).
    """

    name: str
    layers: int
    kv_heads: int
    head_dim: int
    num_heads: int
    params: int
    dtype_bytes: int = 2

    def __post_init__(self) -> None:
        for field in ("layers", "kv_heads", "head_dim", "num_heads", "params", "dtype_bytes"):
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise CostModelError(f"model {self.name!r}: {field} must be a positive int, got {value!r}")

    @property
    def kv_bytes_per_token(self) -> int:
        """Bytes of K and V of one token over all layers."""
        return self.layers * 2 * self.kv_heads * self.head_dim * self.dtype_bytes

    @property
    def flops_per_token(self) -> float:
        """FLOPs of the dense linear layers for one token (2 per parameter: multiply and add)."""
        return 2.0 * self.params

    @property
    def attention_flops_per_token_per_context_token(self) -> float:
        """Attention FLOPs of one query token per token it attends to (QK^T and PV over all layers)."""
        return 4.0 * self.layers * self.num_heads * self.head_dim

    @property
    def weight_bytes(self) -> int:
        """Bytes of all weights (read once per decode step)."""
        return self.params * self.dtype_bytes

    @classmethod
    def from_hf_config(cls, name: str, config: dict, dtype: str = "bfloat16", params: int | None = None
                       ) -> "ModelProfile":
        """A profile from a Hugging Face `config.json` dict; `params` is estimated when not given."""
        try:
            layers = int(config["num_hidden_layers"])
            num_heads = int(config["num_attention_heads"])
            kv_heads = int(config.get("num_key_value_heads") or num_heads)
            head_dim = int(config.get("head_dim") or config["hidden_size"] // num_heads)
        except KeyError as exc:
            raise CostModelError(f"model {name!r}: config has no {exc.args[0]!r}") from None
        if params is None:
            params = estimate_params(config)
        return cls(name, layers, kv_heads, head_dim, num_heads, int(params), dtype_bytes(dtype))

    @classmethod
    def from_folder(cls, name: str, folder, dtype: str = "bfloat16") -> "ModelProfile":
        """A profile from a Hugging Face folder: config.json, and the exact parameter count read from the
        safetensors headers (no tensor is loaded)."""
        folder = Path(folder)
        config_path = folder / "config.json"
        if not config_path.is_file():
            raise CostModelError(f"model {name!r}: no config.json in {folder}")
        files = sorted(folder.glob("*.safetensors"))
        if not files:
            raise CostModelError(f"model {name!r}: no *.safetensors in {folder}; pass params to from_hf_config")
        config = json.loads(config_path.read_text())
        return cls.from_hf_config(name, config, dtype, params=sum(safetensors_params(f) for f in files))


def safetensors_params(path) -> int:
    """Number of elements of all tensors in a safetensors file, from its JSON header."""
    with open(path, "rb") as f:
        (header_len,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(header_len))
    return sum(math.prod(info["shape"]) for key, info in header.items() if key != "__metadata__")


def estimate_params(config: dict) -> int:
    """Parameter count of a dense Llama-family model from its config: embeddings, per-layer attention
    (q/k/v/o, q/k/v biases for Qwen2 or `attention_bias`, q/k norms for Qwen3), a gated MLP, two norms
    per layer, the final norm, and the lm_head unless `tie_word_embeddings`."""
    try:
        hidden = int(config["hidden_size"])
        vocab = int(config["vocab_size"])
        inter = int(config["intermediate_size"])
        layers = int(config["num_hidden_layers"])
        heads = int(config["num_attention_heads"])
    except KeyError as exc:
        raise CostModelError(f"cannot estimate parameters: config has no {exc.args[0]!r}; pass params=") from None
    kv = int(config.get("num_key_value_heads") or heads)
    hd = int(config.get("head_dim") or hidden // heads)
    model_type = config.get("model_type", "")
    attn = hidden * heads * hd + 2 * hidden * kv * hd + heads * hd * hidden
    if config.get("attention_bias") or model_type == "qwen2":
        attn += heads * hd + 2 * kv * hd
    if model_type == "qwen3":
        attn += 2 * hd  # q_norm, k_norm
    per_layer = attn + 3 * hidden * inter + 2 * hidden
    lm_head = 0 if config.get("tie_word_embeddings", False) else vocab * hidden
    return vocab * hidden + layers * per_layer + hidden + lm_head


KNOWN_MODELS: dict[str, ModelProfile] = {
    "llama-3-8b": ModelProfile("llama-3-8b", layers=32, kv_heads=8, head_dim=128, num_heads=32,
                               params=8_030_261_248),
    "qwen3-8b": ModelProfile("qwen3-8b", layers=36, kv_heads=8, head_dim=128, num_heads=32, params=8_190_735_360),
    "smollm2": ModelProfile("smollm2", layers=30, kv_heads=3, head_dim=64, num_heads=9, params=134_515_008),
}


def model_profile(name: str) -> ModelProfile:
    """The built-in profile of a known model (bf16)."""
    try:
        return KNOWN_MODELS[name]
    except KeyError:
        raise CostModelError(f"unknown model {name!r}; known models: {sorted(KNOWN_MODELS)} "
                             "(or build one with ModelProfile.from_folder / from_hf_config)") from None
