"""The Llama-family decoder forward pass (Llama, SmolLM2, Qwen2) over the paged KV cache."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from aaflow.engine.attention import AttentionBatch, PackedBatch, paged_attention
from aaflow.engine.cascade import CascadeBatch, cascade_attention
from aaflow.engine.config import ModelConfig
from aaflow.engine.decode_kernel import KernelDecodeBatch, kernel_decode_attention
from aaflow.engine.fixed_attention import FixedBatch, fixed_attention
from aaflow.engine.kv_cache import PagedKVCache
from aaflow.engine.linear import Linear
from aaflow.engine.rope import RotaryTable
from aaflow.engine.run_attention import (GatheredDecodeBatch, RunsDecodeBatch, gathered_decode_attention,
                                         runs_decode_attention)
from aaflow.engine.tiled_attention import TiledPrefillBatch, tiled_attention
from aaflow.engine.weights import LayerWeights, ModelWeights


Batch = (AttentionBatch | PackedBatch | CascadeBatch | FixedBatch | RunsDecodeBatch | GatheredDecodeBatch
         | KernelDecodeBatch | TiledPrefillBatch)


_ATTENTION = {CascadeBatch: cascade_attention, FixedBatch: fixed_attention,
              RunsDecodeBatch: runs_decode_attention, GatheredDecodeBatch: gathered_decode_attention,
              KernelDecodeBatch: kernel_decode_attention, TiledPrefillBatch: tiled_attention}  # others: paged_attention


class LlamaModel:
    """Stateless apart from its weights: all KV state lives in the `PagedKVCache` passed in.

    `deterministic`: a token's logits do not depend on how many tokens share its forward pass or
    how its prompt was chunked (the runner then builds `FixedBatch`es; see fixed_attention.py).
    """

    def __init__(self, config: ModelConfig, weights: ModelWeights, dtype: torch.dtype,
                 deterministic: bool = False) -> None:
        self.config = config
        self.weights = weights
        self.dtype = dtype
        self.deterministic = deterministic
        self.rotary = RotaryTable(config, dtype)

    def _linear(self, linear: Linear, x: torch.Tensor) -> torch.Tensor:  # x: [T, in] -> [T, out]
        if self.deterministic and x.shape[0] == 1:  # oneDNN's one-row kernel rounds unlike the many-row one
            return linear(x.expand(2, -1).contiguous())[:1]
        return linear(x)

    def _rms_norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        # HF order: normalize in float32, cast back, then scale
        normed = F.rms_norm(x.float(), (x.shape[-1],), eps=self.config.rms_norm_eps)
        return weight * normed.to(self.dtype)

    def _layer(
        self, index: int, w: LayerWeights, h: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor],
        cache: PagedKVCache, batch: Batch,
    ) -> torch.Tensor:  # h: [T, hidden] -> [T, hidden]
        c = self.config
        T = h.shape[0]
        qkv = self._linear(w.qkv, self._rms_norm(h, w.input_norm))  # [T, q_size + 2 * kv_size]
        qk = qkv[:, : c.q_size + c.kv_size].view(T, c.num_heads + c.num_kv_heads, c.head_dim)
        qk = self.rotary.rotate(qk, *cos_sin)  # q and k heads rotated together: [T, H + Hkv, D]
        q, k = qk.split([c.num_heads, c.num_kv_heads], dim=1)
        v = qkv[:, c.q_size + c.kv_size :].reshape(T, c.num_kv_heads, c.head_dim)
        attend = _ATTENTION.get(type(batch), paged_attention)
        attn = attend(index, q, k, v, cache, batch)  # [T, H * D]
        h = h + self._linear(w.o, attn)
        gate, up = self._linear(w.gate_up, self._rms_norm(h, w.post_norm)).chunk(2, dim=-1)  # [T, I] each
        return h + self._linear(w.down, F.silu(gate) * up)

    @torch.inference_mode()
    def run_layers(
        self, input_ids: torch.Tensor, positions: torch.Tensor, cache: PagedKVCache,
        batch: Batch, num_layers: int,
    ) -> torch.Tensor:  # input_ids, positions: [T] -> hidden states after `num_layers` layers [T, hidden]
        """Run the first `num_layers` layers, writing the new tokens' K/V of those layers to the cache."""
        h = self.weights.embed[input_ids]  # [T, hidden]
        cos_sin = self.rotary.at(positions)
        for index in range(num_layers):
            h = self._layer(index, self.weights.layers[index], h, cos_sin, cache, batch)
        return h

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,  # [T]
        positions: torch.Tensor,  # [T]
        cache: PagedKVCache,
        batch: Batch,
        logit_rows: torch.Tensor | None = None,  # [R] rows to project to the vocabulary; None = all
    ) -> torch.Tensor:  # float32 logits [R, vocab]
        h = self.run_layers(input_ids, positions, cache, batch, self.config.num_layers)
        if logit_rows is not None:
            h = h[logit_rows]
        return self._linear(self.weights.lm_head, self._rms_norm(h, self.weights.final_norm)).float()
