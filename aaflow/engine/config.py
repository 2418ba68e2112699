"""The model configuration the built-in engine understands, parsed from an HF `config.json`."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from aaflow.common.errors import ModelNotFoundError, UnsupportedModelError

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM")
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


@dataclass(frozen=True)
class ModelConfig:
    """Shapes and constants of a Llama-family decoder (Llama, SmolLM2, Qwen2)."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    rope_theta: float
    rope_type: str = "default"
    rope_scaling: tuple[tuple[str, float], ...] = ()  # the scaling parameters, sorted (hashable)
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    eos_token_ids: tuple[int, ...] = ()

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        """Bytes of K and V for one token across all layers."""
        return self.num_layers * 2 * self.kv_size * dtype_bytes

    @classmethod
    def from_folder(cls, folder: Path) -> "ModelConfig":
        path = Path(folder) / "config.json"
        try:
            raw = json.loads(path.read_text())
        except FileNotFoundError as exc:
            raise ModelNotFoundError(f"{path} is missing: not a Hugging Face model folder") from exc
        except json.JSONDecodeError as exc:
            raise ModelNotFoundError(f"{path} is not valid JSON ({exc}); the model folder is broken") from exc
        return cls.from_hf_dict(raw, source=str(path))

    @classmethod
    def from_hf_dict(cls, raw: dict[str, Any], source: str = "config") -> "ModelConfig":
        arch = (raw.get("architectures") or ["?"])[0]
        if arch not in SUPPORTED_ARCHITECTURES:
            raise UnsupportedModelError(
                f"{source}: architecture {arch!r} is not supported by the built-in engine "
                f"(supported: {', '.join(SUPPORTED_ARCHITECTURES)}); use engine: vllm for other models"
            )
        if raw.get("hidden_act", "silu") != "silu":
            raise UnsupportedModelError(f"{source}: hidden_act {raw['hidden_act']!r} is not supported (only silu)")
        if raw.get("use_sliding_window"):
            raise UnsupportedModelError(f"{source}: sliding-window attention is not supported by the built-in engine")
        rope_type, theta, scaling = _parse_rope(raw, source)
        num_heads = raw["num_attention_heads"]
        is_qwen2 = arch == "Qwen2ForCausalLM"
        eos = raw.get("eos_token_id")
        return cls(
            architecture=arch,
            vocab_size=raw["vocab_size"],
            hidden_size=raw["hidden_size"],
            intermediate_size=raw["intermediate_size"],
            num_layers=raw["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=raw.get("num_key_value_heads") or num_heads,
            head_dim=raw.get("head_dim") or raw["hidden_size"] // num_heads,
            rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
            max_position_embeddings=raw.get("max_position_embeddings", 2048),
            rope_theta=theta,
            rope_type=rope_type,
            rope_scaling=scaling,
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            qkv_bias=True if is_qwen2 else bool(raw.get("attention_bias", False)),
            o_bias=False if is_qwen2 else bool(raw.get("attention_bias", False)),
            mlp_bias=bool(raw.get("mlp_bias", False)),
            eos_token_ids=tuple(eos if isinstance(eos, list) else [eos] if eos is not None else []),
        )


def _parse_rope(raw: dict[str, Any], source: str) -> tuple[str, float, tuple[tuple[str, float], ...]]:
    """RoPE type, theta and scaling params from either transformers-5 `rope_parameters` or the older keys."""
    params = dict(raw.get("rope_parameters") or {})
    if not params:
        params = dict(raw.get("rope_scaling") or {})
        params.setdefault("rope_theta", raw.get("rope_theta", 10000.0))
    rope_type = params.pop("rope_type", None) or params.pop("type", None) or "default"
    params.pop("type", None)
    theta = float(params.pop("rope_theta", raw.get("rope_theta", 10000.0)))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise UnsupportedModelError(
            f"{source}: RoPE scaling {rope_type!r} is not supported (supported: {', '.join(SUPPORTED_ROPE_TYPES)}); "
            "position-dependent scalings such as 'dynamic' would change cached keys as context grows"
        )
    scaling = tuple(sorted((k, float(v)) for k, v in params.items() if isinstance(v, (int, float))))
    return rope_type, theta, scaling
