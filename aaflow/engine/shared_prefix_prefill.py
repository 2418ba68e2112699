"""Prefill chunks of several sequences that continue one shared prefix, attended in cascade.

When a pack of prompts share their first blocks (B agents reading one system prompt, cached once),
each chunk attends over the whole context alone: the prefix's keys are read and multiplied once per
member. Here the members' queries go through the flash kernel over the prefix together, in one
call, and each member's own keys (after the prefix) in one call of its own; the two parts merge by
their log-sum-exps. With AMX this attends several short chunks over a long prefix in less time than
one call per member (docs/RESULTS-history.md). Used with the flash prefill path only
(`prefill_kernel`); where the AMX kernel runs (`amx_attention`) both parts go through it.
"""

from __future__ import annotations

import torch

from aaflow.engine.amx_attention import amx_attention, amx_kernel, merge_parts

SHARED_PREFIX_MIN_TOKENS = 512  # shorter prefixes: one call per member costs about as much

_flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu  # -> (out [1, H, T, D], lse [1, H, T])


def shared_prefix_tokens(contexts: list[torch.Tensor], starts: list[int], min_tokens: int | None = None) -> int:
    """Leading slots every context holds in common, up to the first new token of any of them; 0
    when fewer than two contexts or fewer than `min_tokens` (default SHARED_PREFIX_MIN_TOKENS)."""
    if len(contexts) < 2:
        return 0
    n = min(starts)
    first = contexts[0][:n]
    for context in contexts[1:]:
        differs = (context[:n] != first[:n]).nonzero()
        n = int(differs[0]) if differs.numel() else n
    return n if n >= (SHARED_PREFIX_MIN_TOKENS if min_tokens is None else min_tokens) else 0


def shared_prefix_attention(
    qs: list[torch.Tensor],  # member i's new tokens' queries [T_i, H, D], positions [starts[i], starts[i] + T_i)
    prefix_k: torch.Tensor,  # [shared, Hkv, D]: the keys every member's context starts with
    prefix_v: torch.Tensor,  # [shared, Hkv, D]
    own_keys: list[torch.Tensor],  # member i's keys after the prefix [starts[i] + T_i - shared, Hkv, D]
    own_values: list[torch.Tensor],  # likewise
    starts: list[int],
) -> list[torch.Tensor]:  # member i's output [T_i, H * D]
    """Causal attention of each member's chunk over its context, the shared prefix read once."""
    kernel = amx_kernel(qs[0])
    if kernel is not None:
        return _amx_shared_prefix(kernel, qs, prefix_k, prefix_v, own_keys, own_values, starts)
    heads, kv_heads, shared = qs[0].shape[1], prefix_k.shape[1], prefix_k.shape[0]
    expand = lambda x: x.transpose(0, 1)[None].repeat_interleave(heads // kv_heads, dim=1)  # noqa: E731  -> [1, H, n, D]
    q_all = torch.cat(qs).transpose(0, 1)[None]  # [1, H, sum T, D]
    prefix_out, prefix_lse = _flash(q_all, expand(prefix_k), expand(prefix_v), 0.0, False)
    outs, row = [], 0
    for q, k, v, start in zip(qs, own_keys, own_values, starts):
        T, own = q.shape[0], k.shape[0]  # own keys: this member's after the prefix, its new tokens last
        allowed = torch.arange(own)[None, :] <= (start - shared + torch.arange(T))[:, None]  # [T, own]
        mask = torch.zeros(T, own, dtype=q.dtype).masked_fill_(~allowed, float("-inf"))[None, None]
        own_out, own_lse = _flash(q.transpose(0, 1)[None], expand(k), expand(v), 0.0, False, attn_mask=mask)
        merged = merge_parts(prefix_out[:, :, row:row + T], prefix_lse[:, :, row:row + T], own_out, own_lse)  # [1, H, T, D]
        outs.append(merged[0].transpose(0, 1).reshape(T, -1))
        row += T
    return outs


def _amx_shared_prefix(kernel, qs, prefix_k, prefix_v, own_keys, own_values, starts) -> list[torch.Tensor]:
    """`shared_prefix_attention` on the AMX kernel: every member's rows over the whole prefix in one
    call, each member's rows over its own keys (query t sees own key j <= start - shared + t) in one."""
    shared = prefix_k.shape[0]
    prefix_out, prefix_lse = amx_attention(kernel, torch.cat(qs), prefix_k, prefix_v, shared)  # [sum T, H, D], [sum T, H]
    outs, row = [], 0
    for q, k, v, start in zip(qs, own_keys, own_values, starts):
        T = q.shape[0]
        own_out, own_lse = amx_attention(kernel, q, k, v, start - shared)
        merged = merge_parts(prefix_out[row:row + T], prefix_lse[row:row + T], own_out, own_lse)  # [T, H, D]
        outs.append(merged.reshape(T, -1))
        row += T
    return outs
