"""The Llama-family decoder forward pass (Llama, SmolLM2, Qwen2) over the paged KV cache."""

from __future__ import annotations

import torch

from aaflow.engine.attention_pass import AttentionPass
from aaflow.engine.config import ModelConfig
from aaflow.engine.elementwise import Elementwise
from aaflow.engine.kv_cache import PagedKVCache
from aaflow.engine.linear import Linear
from aaflow.engine.rope import RotaryTable
from aaflow.engine.weights import LayerWeights, ModelWeights


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
        self.elementwise = Elementwise(dtype, config.rms_norm_eps)

    def _linear(self, linear: Linear, x: torch.Tensor) -> torch.Tensor:  # x: [T, in] -> [T, out]
        return linear(x, batch_invariant=self.deterministic)

    def _layer(
        self, index: int, w: LayerWeights, h: torch.Tensor, delta: torch.Tensor | None,
        cos_sin: tuple[torch.Tensor, torch.Tensor], cache: PagedKVCache, batch: AttentionPass,
    ) -> tuple[torch.Tensor, torch.Tensor]:  # h, delta: [T, hidden] -> (h, delta) [T, hidden] each
        """One decoder layer over the residual stream h + delta (delta: the previous layer's MLP
        output, not yet added, so the add fuses with this layer's first norm; None at layer 0).
        Returns the stream and this layer's MLP output, again not yet added."""
        c = self.config
        ew = self.elementwise
        T = h.shape[0]
        h, x = ew.add_norm(h, delta, w.input_norm)
        qkv = self._linear(w.qkv, x)  # [T, q_size + 2 * kv_size]
        qk = qkv[:, : c.q_size + c.kv_size].view(T, c.num_heads + c.num_kv_heads, c.head_dim)
        qk = ew.rotate(qk, *cos_sin)  # q and k heads rotated together: [T, H + Hkv, D]
        q, k = qk.split([c.num_heads, c.num_kv_heads], dim=1)
        v = qkv[:, c.q_size + c.kv_size :].reshape(T, c.num_kv_heads, c.head_dim)
        attn = batch.attend(index, q, k, v, cache)  # [T, H * D]
        h, x = ew.add_norm(h, self._linear(w.o, attn), w.post_norm)
        return h, self._linear(w.down, ew.silu_mul(self._linear(w.gate_up, x)))  # gate_up: [T, 2I]

    @torch.inference_mode()
    def run_layers(
        self, input_ids: torch.Tensor, positions: torch.Tensor, cache: PagedKVCache,
        batch: AttentionPass, num_layers: int,
    ) -> torch.Tensor:  # input_ids, positions: [T] -> hidden states after `num_layers` layers [T, hidden]
        """Run the first `num_layers` layers, writing the new tokens' K/V of those layers to the cache."""
        h, delta = self._stream(input_ids, positions, cache, batch, num_layers)
        return h if delta is None else h + delta

    def _stream(
        self, input_ids: torch.Tensor, positions: torch.Tensor, cache: PagedKVCache, batch: AttentionPass,
        num_layers: int,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:  # the residual stream as (h, delta), [T, hidden] each
        h = self.weights.embed[input_ids]  # [T, hidden]
        cos_sin = self.rotary.at(positions)
        delta = None
        for index in range(num_layers):
            h, delta = self._layer(index, self.weights.layers[index], h, delta, cos_sin, cache, batch)
        return h, delta

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,  # [T]
        positions: torch.Tensor,  # [T]
        cache: PagedKVCache,
        batch: AttentionPass,
        logit_rows: torch.Tensor | None = None,  # [R] rows to project to the vocabulary; None = all
    ) -> torch.Tensor:  # float32 logits [R, vocab]
        h, delta = self._stream(input_ids, positions, cache, batch, self.config.num_layers)
        if logit_rows is not None:
            h, delta = h[logit_rows], None if delta is None else delta[logit_rows]
        _, normed = self.elementwise.add_norm(h, delta, self.weights.final_norm)
        return self._linear(self.weights.lm_head, normed).float()
