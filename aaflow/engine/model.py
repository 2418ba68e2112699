"""The Llama-family decoder forward pass (Llama, SmolLM2, Qwen2) over the paged KV cache."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from aaflow.engine.attention import AttentionBatch, paged_attention
from aaflow.engine.config import ModelConfig
from aaflow.engine.kv_cache import PagedKVCache
from aaflow.engine.rope import RotaryTable
from aaflow.engine.weights import LayerWeights, ModelWeights


class LlamaModel:
    """Stateless apart from its weights: all KV state lives in the `PagedKVCache` passed in."""

    def __init__(self, config: ModelConfig, weights: ModelWeights, dtype: torch.dtype) -> None:
        self.config = config
        self.weights = weights
        self.dtype = dtype
        self.rotary = RotaryTable(config, dtype)

    def _rms_norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        # HF order: normalize in float32, cast back, then scale
        normed = F.rms_norm(x.float(), (x.shape[-1],), eps=self.config.rms_norm_eps)
        return weight * normed.to(self.dtype)

    def _layer(
        self, index: int, w: LayerWeights, h: torch.Tensor, positions: torch.Tensor,
        cache: PagedKVCache, batch: AttentionBatch,
    ) -> torch.Tensor:  # h: [T, hidden] -> [T, hidden]
        c = self.config
        x = self._rms_norm(h, w.input_norm)
        qkv = F.linear(x, w.qkv, w.qkv_bias)  # [T, q_size + 2 * kv_size]
        q, k, v = qkv.split([c.q_size, c.kv_size, c.kv_size], dim=-1)
        T = h.shape[0]
        q = self.rotary.apply(q.view(T, c.num_heads, c.head_dim), positions)  # [T, H, D]
        k = self.rotary.apply(k.view(T, c.num_kv_heads, c.head_dim), positions)  # [T, Hkv, D]
        v = v.reshape(T, c.num_kv_heads, c.head_dim)
        attn = paged_attention(index, q, k, v, cache, batch)  # [T, H * D]
        h = h + F.linear(attn, w.o, w.o_bias)
        x = self._rms_norm(h, w.post_norm)
        gate, up = F.linear(x, w.gate_up, w.gate_up_bias).chunk(2, dim=-1)  # [T, I] each
        return h + F.linear(F.silu(gate) * up, w.down, w.down_bias)

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,  # [T]
        positions: torch.Tensor,  # [T]
        cache: PagedKVCache,
        batch: AttentionBatch,
        logit_rows: torch.Tensor | None = None,  # [R] rows to project to the vocabulary; None = all
    ) -> torch.Tensor:  # float32 logits [R, vocab]
        h = self.weights.embed[input_ids]  # [T, hidden]
        for index, layer in enumerate(self.weights.layers):
            h = self._layer(index, layer, h, positions, cache, batch)
        if logit_rows is not None:
            h = h[logit_rows]
        h = self._rms_norm(h, self.weights.final_norm)
        return F.linear(h, self.weights.lm_head).float()
