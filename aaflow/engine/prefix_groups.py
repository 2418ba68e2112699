"""Prefill chunks over cached prefixes, grouped by the prefix they continue, in tiles (bf16, no AMX).

A serving burst packs many short chunks (each agent's own question, tens of tokens) over long
cached documents that several chunks share. Alone, each chunk gathers its whole context's keys and
multiplies them in products of a few dozen rows: per layer and chunk, a gather and a handful of small
calls, far below the machine's rate. Here the chunks whose contexts begin with the same slots (at
least GROUP_MIN_TOKENS of them: forks of one document) attend together, per layer:
- every member's rows against the shared keys in one product per kv head (the keys read in place
  when they are one run of slots);
- against each member's own keys (after the prefix, its new tokens last, padded to the longest) in
  one batched product, masked causally per member;
- one softmax over both parts, then the probabilities times the values the same two ways.
The rounding is the tiles' (`tiled_prefill_attention`): scores in bf16, softmax computed in fp32
inside, probabilities rounded to bf16 before the product with V; the output sums two products.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from aaflow.engine.attention import run_start
from aaflow.engine.shared_prefix_prefill import shared_prefix_tokens

GROUP_MIN_TOKENS = 256  # a shorter shared prefix is attended per member (not tuned)


@dataclass
class PrefixGroup:
    """Members of a packed prefill that share their first `shared` context slots, and what each
    layer needs to attend them together (built once per forward pass)."""

    members: list[int]  # indices into the batch's sequences
    prefix: torch.Tensor  # [S] the shared slots
    prefix_run: int | None  # their first slot when consecutive (read in place), else None
    own_slots: torch.Tensor  # [M, Omax] each member's slots after the prefix, padded with its first
    query_rows: torch.Tensor  # [M * Tmax] each padded query row's row in the packed chunk (padding: 0)
    valid_rows: torch.Tensor  # [sum T] the padded rows that are real, member by member
    rows: torch.Tensor  # [sum T] the members' rows in the packed chunk, member by member
    seen: torch.Tensor  # [M, Tmax, Omax] whether a member's query sees its own key
    tmax: int
    mask: torch.Tensor | None = None  # [M, 1, Tmax, 1, Omax] `seen` as 0 / -inf in the queries' dtype

    @classmethod
    def build(cls, members: list[int], contexts: list[torch.Tensor], starts: list[int], offsets: list[int],
              shared: int) -> "PrefixGroup":
        prefix = contexts[members[0]][:shared]
        lengths = [offsets[i + 1] - offsets[i] for i in members]
        tmax = max(lengths)
        own = [contexts[i][shared:] for i in members]
        omax = max(o.numel() for o in own)
        own_slots = torch.stack([torch.cat([o, o[:1].expand(omax - o.numel())]) for o in own])
        rows = torch.zeros(len(members), tmax, dtype=torch.long)
        for m, (i, t) in enumerate(zip(members, lengths)):
            rows[m, :t] = torch.arange(offsets[i], offsets[i] + t)
        valid = torch.cat([torch.arange(m * tmax, m * tmax + t) for m, t in enumerate(lengths)])
        position = torch.tensor([starts[i] - shared for i in members])[:, None, None]  # own index of the first query
        key = torch.arange(omax)[None, None, :]
        query = torch.arange(tmax)[None, :, None]
        own_len = torch.tensor([o.numel() for o in own])[:, None, None]
        seen = (key <= position + query) & (key < own_len)  # [M, Tmax, Omax]
        rows = rows.view(-1)
        return cls(members, prefix, run_start(prefix), own_slots, rows, valid, rows[valid], seen, tmax)

    def attend(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:
        """q: the packed chunk's queries [T, H, D]; k_cache, v_cache: [slots, Hkv, D] -> the members'
        outputs [sum T_i, H * D], member by member."""
        heads, dim = q.shape[1], q.shape[2]
        if self.mask is None or self.mask.dtype != q.dtype:
            self.mask = torch.zeros(self.seen.shape, dtype=q.dtype).masked_fill_(~self.seen, float("-inf"))[:, None, :, None]
        kv_heads = k_cache.shape[1]
        group, members, tmax = heads // kv_heads, len(self.members), self.tmax
        shared = self.prefix.numel()
        if self.prefix_run is not None:
            pk, pv = k_cache[self.prefix_run:self.prefix_run + shared], v_cache[self.prefix_run:self.prefix_run + shared]
        else:
            pk, pv = k_cache.index_select(0, self.prefix), v_cache.index_select(0, self.prefix)  # [S, Hkv, D]
        ok, ov = k_cache[self.own_slots], v_cache[self.own_slots]  # [M, Omax, Hkv, D]
        omax = ok.shape[1]
        qp = (q.index_select(0, self.query_rows) * dim ** -0.5).view(members, tmax, kv_heads, group, dim)
        rows = members * tmax * group
        qh = qp.permute(2, 0, 1, 3, 4).reshape(kv_heads, rows, dim)  # [Hkv, (m, t, g), D]
        scores = torch.empty(kv_heads, rows, shared + omax, dtype=q.dtype)
        torch.matmul(qh, pk.permute(1, 2, 0), out=scores[:, :, :shared])  # [Hkv, R, S]
        own = torch.matmul(qp.permute(0, 2, 1, 3, 4).reshape(members, kv_heads, tmax * group, dim),
                           ok.permute(0, 2, 3, 1))  # [M, Hkv, Tmax*G, Omax]
        own = own.view(members, kv_heads, tmax, group, omax) + self.mask
        scores[:, :, shared:] = own.permute(1, 0, 2, 3, 4).reshape(kv_heads, rows, omax)
        torch.ops.aten._softmax.out(scores, -1, False, out=scores)  # in place; bf16 out, fp32 inside
        out = torch.matmul(scores[:, :, :shared], pv.transpose(0, 1))  # [Hkv, R, D]
        probs = scores[:, :, shared:].reshape(kv_heads, members, tmax * group, omax).transpose(0, 1)
        out = out.view(kv_heads, members, tmax * group, dim) + torch.matmul(probs, ov.permute(0, 2, 1, 3)).transpose(0, 1)
        out = out.view(kv_heads, members, tmax, group, dim).permute(1, 2, 0, 3, 4).reshape(members * tmax, heads * dim)
        return out.index_select(0, self.valid_rows)


def prefix_groups(tiled: list[int], contexts: list[torch.Tensor], starts: list[int],
                  offsets: list[int]) -> tuple[list[PrefixGroup], list[int]]:
    """The groups among the `tiled` sequences (two or more continuing at least GROUP_MIN_TOKENS shared
    slots) and the sequences left to attend alone."""
    by_first: dict[int, list[int]] = {}
    for i in tiled:
        if starts[i] >= GROUP_MIN_TOKENS:
            by_first.setdefault(int(contexts[i][0]), []).append(i)
    groups, grouped = [], set()
    for members in by_first.values():
        shared = shared_prefix_tokens([contexts[i] for i in members], [starts[i] for i in members], GROUP_MIN_TOKENS)
        if shared:
            groups.append(PrefixGroup.build(members, contexts, starts, offsets, shared))
            grouped.update(members)
    return groups, [i for i in tiled if i not in grouped]
