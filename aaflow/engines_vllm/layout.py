"""vLLM's CPU paged KV cache, read and written per token (runs in the vLLM process only).

vLLM's CPU attention backend keeps one tensor per layer, [num_blocks, num_kv_heads, block_size,
2 * head_dim], but the inside of a block is ISA-specific: with AMX (bf16) keys and values are
stored VNNI-packed (token pairs interleaved), with "vec"/"vec16" keys are stored dim-major.
Rather than hard-code each packing, `CPUBlockLayout.learn` runs vLLM's own
`cpu_attn_reshape_and_cache` kernel once on a one-block scratch cache with index-encoded inputs
and records where every (token, head, dim) element of K and V lands; it refuses (raises
`VLLMKVLayoutError`) unless that is an exact one-to-one placement, then round-trip checks it.
Saving and loading are then exact gathers/scatters with that index: no arithmetic on the values.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from aaflow.engines_vllm.errors import VLLMKVLayoutError

_EXACT_INT_LIMIT = {torch.bfloat16: 256, torch.float16: 2048, torch.float32: 2**24}


@dataclass(frozen=True)
class CPUBlockLayout:
    """Element offsets of K and V inside one flattened block of a layer's cache tensor.

    Attributes:
        block_size, num_kv_heads, head_dim, dtype, isa: what the index was learned for.
        k_index, v_index: [block_size, num_kv_heads, head_dim] int64 offsets into
            `layer_cache.view(num_blocks, -1)[block]`.
    """

    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    isa: str
    k_index: torch.Tensor
    v_index: torch.Tensor

    @classmethod
    def learn(cls, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype, isa: str) -> "CPUBlockLayout":
        """Learn the placement from vLLM's kernel (see the module docstring)."""
        from vllm import _custom_ops as ops  # optional: vLLM, present where this layout is used

        N, H, C = block_size, num_kv_heads, head_dim
        limit = _EXACT_INT_LIMIT.get(dtype)
        if limit is None or max(N, H, C) + 1 > limit:
            raise VLLMKVLayoutError(f"cannot learn vLLM's CPU KV layout for dtype {dtype} "
                                    f"(block {N}, heads {H}, head_dim {C}): the index does not fit exactly")
        grid = torch.stack(torch.meshgrid(torch.arange(N), torch.arange(H), torch.arange(C), indexing="ij"))  # [3, N, H, C]
        block_numel = H * N * 2 * C

        def placement(write_key: bool) -> torch.Tensor:  # -> [N, H, C] offsets
            fields = []
            for f in range(3):
                cache = torch.zeros(1, H, N, 2 * C, dtype=dtype)
                key_cache, value_cache = cache.view(1, H, 2 * N, C).chunk(2, dim=2)
                enc = (grid[f] + 1).to(dtype)  # [N, H, C], exact small integers
                zero = torch.zeros(N, H, C, dtype=dtype)
                k, v = (enc, zero) if write_key else (zero, enc)
                ops.cpu_attn_reshape_and_cache(k, v, key_cache, value_cache, torch.arange(N), isa)
                fields.append(cache.view(-1).to(torch.int64) - 1)  # [block_numel], -1 where unwritten
            written = fields[0] >= 0
            pos = written.nonzero().squeeze(1)
            if pos.numel() != N * H * C or any((fl[pos] < 0).any() for fl in fields):
                raise VLLMKVLayoutError(f"vLLM's CPU cache (isa {isa!r}) does not store each K/V element once; "
                                        "aaflow cannot convert this layout")
            flat = (fields[0][pos] * H + fields[1][pos]) * C + fields[2][pos]
            index = torch.full((N * H * C,), -1, dtype=torch.int64)
            index[flat] = pos
            if (index < 0).any():
                raise VLLMKVLayoutError(f"vLLM's CPU cache (isa {isa!r}) placement is not one-to-one; "
                                        "aaflow cannot convert this layout")
            return index.view(N, H, C)

        k_index, v_index = placement(True), placement(False)
        if torch.isin(k_index, v_index).any() or k_index.max() >= block_numel:
            raise VLLMKVLayoutError(f"vLLM's CPU cache (isa {isa!r}): K and V overlap; aaflow cannot convert this layout")
        layout = cls(N, H, C, dtype, isa, k_index, v_index)
        layout._round_trip_check(ops)
        return layout

    def _round_trip_check(self, ops) -> None:
        """Write random K/V with vLLM's kernel into two blocks, read them back with the index: must be equal."""
        N, H, C = self.block_size, self.num_kv_heads, self.head_dim
        g = torch.Generator().manual_seed(0)
        k = torch.randn(N + 5, H, C, generator=g).to(self.dtype)
        v = torch.randn(N + 5, H, C, generator=g).to(self.dtype)
        cache = torch.zeros(3, H, N, 2 * C, dtype=self.dtype)
        key_cache, value_cache = cache.view(3, H, 2 * N, C).chunk(2, dim=2)
        slots = torch.cat([torch.arange(2 * N, 3 * N), torch.arange(N, N + 5)])  # block 2 full, block 1 partial
        ops.cpu_attn_reshape_and_cache(k, v, key_cache, value_cache, slots, self.isa)
        kv = self.gather(cache, slots)
        if not (torch.equal(kv[0], k) and torch.equal(kv[1], v)):
            raise VLLMKVLayoutError(f"vLLM's CPU cache (isa {self.isa!r}): learned layout fails its round trip; "
                                    "aaflow cannot convert this layout")

    def _index(self, layer_cache: torch.Tensor, slots: torch.Tensor):
        blocks = (slots // self.block_size).view(-1, 1, 1)  # [T, 1, 1]
        offsets = slots % self.block_size  # [T]
        return layer_cache.view(layer_cache.shape[0], -1), blocks, offsets

    def gather(self, layer_cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        """layer_cache: [num_blocks, H, block_size, 2C]; slots: [T] -> KV [2, T, H, C] (a copy)."""
        flat, blocks, offsets = self._index(layer_cache, slots)
        return torch.stack([flat[blocks, self.k_index[offsets]], flat[blocks, self.v_index[offsets]]])

    def scatter(self, layer_cache: torch.Tensor, slots: torch.Tensor, kv: torch.Tensor) -> None:
        """slots: [T]; kv: [2, T, H, C] -> stored into layer_cache [num_blocks, H, block_size, 2C] in place."""
        flat, blocks, offsets = self._index(layer_cache, slots)
        flat[blocks, self.k_index[offsets]] = kv[0]
        flat[blocks, self.v_index[offsets]] = kv[1]
