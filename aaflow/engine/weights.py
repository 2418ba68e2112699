"""Load a Llama-family checkpoint (HF safetensors) into fused per-layer weights."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from aaflow.engine.config import ModelConfig
from aaflow.engine.linear import Linear, can_prepack, fp32_on_onednn
from aaflow.common.errors import ModelNotFoundError


@dataclass
class LayerWeights:
    """One decoder layer; q/k/v and gate/up are fused so each is one matmul."""

    input_norm: torch.Tensor  # [hidden]
    qkv: Linear  # hidden -> q_size + 2 * kv_size
    o: Linear  # q_size -> hidden
    post_norm: torch.Tensor  # [hidden]
    gate_up: Linear  # hidden -> 2 * intermediate
    down: Linear  # intermediate -> hidden


@dataclass
class ModelWeights:
    embed: torch.Tensor  # [vocab, hidden]
    layers: list[LayerWeights]
    final_norm: torch.Tensor  # [hidden]
    lm_head: Linear  # hidden -> vocab (the embedding matrix when tied)

    def nbytes(self) -> int:
        """Bytes of weights a decode step reads (the embedding table counts once, as the head)."""
        norms = sum(t.numel() * t.element_size() for t in [self.final_norm] +
                    [n for layer in self.layers for n in (layer.input_norm, layer.post_norm)])
        linears = sum(lin.nbytes for layer in self.layers for lin in (layer.qkv, layer.o, layer.gate_up, layer.down))
        return norms + linears + self.lm_head.nbytes


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

    def cat(names: list[str]) -> torch.Tensor:
        return torch.cat([take(n) for n in names])

    pack, onednn = can_prepack(dtype), fp32_on_onednn(dtype)

    layers = []
    for i in range(config.num_layers):
        p = f"model.layers.{i}."
        attn, mlp = p + "self_attn.", p + "mlp."
        qkv_bias = cat([attn + f"{x}_proj.bias" for x in "qkv"]) if config.qkv_bias else None
        gate_up_bias = cat([mlp + "gate_proj.bias", mlp + "up_proj.bias"]) if config.mlp_bias else None
        layers.append(LayerWeights(
            input_norm=take(p + "input_layernorm.weight"),
            qkv=Linear(cat([attn + f"{x}_proj.weight" for x in "qkv"]), qkv_bias, pack, onednn),
            o=Linear(take(attn + "o_proj.weight"), maybe(attn + "o_proj.bias", config.o_bias), pack, onednn),
            post_norm=take(p + "post_attention_layernorm.weight"),
            gate_up=Linear(cat([mlp + "gate_proj.weight", mlp + "up_proj.weight"]), gate_up_bias, pack, onednn),
            down=Linear(take(mlp + "down_proj.weight"), maybe(mlp + "down_proj.bias", config.mlp_bias), pack, onednn),
        ))
    embed = take("model.embed_tokens.weight")
    tied = config.tie_word_embeddings or "lm_head.weight" not in raw
    return ModelWeights(
        embed=embed,
        layers=layers,
        final_norm=take("model.norm.weight"),
        lm_head=Linear(embed if tied else take("lm_head.weight"), None, pack, onednn),
    )
