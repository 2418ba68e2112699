"""Load a Llama-family checkpoint (HF safetensors) into fused per-layer weights."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from aaflow.engine.config import ModelConfig
from aaflow.errors import ModelNotFoundError


@dataclass
class LayerWeights:
    """One decoder layer; q/k/v and gate/up are fused so each is one matmul."""

    input_norm: torch.Tensor  # [hidden]
    qkv: torch.Tensor  # [q_size + 2 * kv_size, hidden]
    qkv_bias: torch.Tensor | None  # [q_size + 2 * kv_size]
    o: torch.Tensor  # [hidden, q_size]
    o_bias: torch.Tensor | None  # [hidden]
    post_norm: torch.Tensor  # [hidden]
    gate_up: torch.Tensor  # [2 * intermediate, hidden]
    gate_up_bias: torch.Tensor | None
    down: torch.Tensor  # [hidden, intermediate]
    down_bias: torch.Tensor | None


@dataclass
class ModelWeights:
    embed: torch.Tensor  # [vocab, hidden]
    layers: list[LayerWeights]
    final_norm: torch.Tensor  # [hidden]
    lm_head: torch.Tensor  # [vocab, hidden]; the embedding itself when tied

    def nbytes(self) -> int:
        """Bytes of weights read per decode step (each tensor once; a tied head is not counted twice)."""
        seen: set[int] = set()
        total = 0
        tensors = [self.embed, self.final_norm, self.lm_head]
        for layer in self.layers:
            tensors += [t for t in vars(layer).values() if t is not None]
        for t in tensors:
            if t.data_ptr() not in seen:
                seen.add(t.data_ptr())
                total += t.numel() * t.element_size()
        return total


def _read_checkpoint(folder: Path) -> dict[str, torch.Tensor]:
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ModelNotFoundError(f"{folder} holds no *.safetensors weights")
    tensors: dict[str, torch.Tensor] = {}
    for f in files:
        try:
            tensors.update(load_file(str(f)))
        except (SafetensorError, OSError) as exc:
            raise ModelNotFoundError(f"{f} is not a readable safetensors file ({exc}); re-fetch the model") from exc
    return tensors


def load_weights(folder: Path, config: ModelConfig, dtype: torch.dtype) -> ModelWeights:
    """Read every tensor the config calls for, cast to `dtype`; a missing tensor is a broken folder."""
    raw = _read_checkpoint(folder)

    def take(name: str) -> torch.Tensor:
        if name not in raw:
            raise ModelNotFoundError(f"{folder}: weight {name!r} is missing from the checkpoint")
        return raw[name].to(dtype)

    def maybe(name: str, present: bool) -> torch.Tensor | None:
        return take(name) if present else None

    layers = []
    for i in range(config.num_layers):
        p = f"model.layers.{i}."
        attn, mlp = p + "self_attn.", p + "mlp."
        qkv_bias = None
        if config.qkv_bias:
            qkv_bias = torch.cat([take(attn + f"{x}_proj.bias") for x in "qkv"])
        gate_up_bias = None
        if config.mlp_bias:
            gate_up_bias = torch.cat([take(mlp + "gate_proj.bias"), take(mlp + "up_proj.bias")])
        layers.append(LayerWeights(
            input_norm=take(p + "input_layernorm.weight"),
            qkv=torch.cat([take(attn + f"{x}_proj.weight") for x in "qkv"]),
            qkv_bias=qkv_bias,
            o=take(attn + "o_proj.weight"),
            o_bias=maybe(attn + "o_proj.bias", config.o_bias),
            post_norm=take(p + "post_attention_layernorm.weight"),
            gate_up=torch.cat([take(mlp + "gate_proj.weight"), take(mlp + "up_proj.weight")]),
            gate_up_bias=gate_up_bias,
            down=take(mlp + "down_proj.weight"),
            down_bias=maybe(mlp + "down_proj.bias", config.mlp_bias),
        ))
    embed = take("model.embed_tokens.weight")
    tied = config.tie_word_embeddings or "lm_head.weight" not in raw
    return ModelWeights(
        embed=embed,
        layers=layers,
        final_norm=take("model.norm.weight"),
        lm_head=embed if tied else take("lm_head.weight"),
    )
