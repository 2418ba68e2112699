"""Selective recomputation of stale KV (CacheBlend-style), for approximate compose.

When a segment's KV was computed without the context now placed before it, its keys can be
re-rotated to their new positions, but its deeper layers never attended to that context. Layer 0's
K/V depend only on the token and its position, so the first layer where staleness shows is layer 1:
recompute layer 0-1 for every candidate token, rank tokens by how far their layer-1 K/V moved, and
recompute the top fraction through all layers, attending over the whole composed context.

Anchors (each segment's last token, which the tokens after the segment read most) are recomputed
first, within the same budget: on SmolLM2 this raised top-1 agreement and lowered the KL divergence
against ranking alone (docs/RESULTS-history.md, "Compose fidelity").
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from aaflow.engine.attention import AttentionBatch
from aaflow.engine.runner import KVRunner


@dataclass(frozen=True)
class BlendResult:
    recomputed_positions: tuple[int, ...]  # positions whose KV was recomputed in every layer
    candidates: int  # positions considered
    mean_deviation: float  # mean relative layer-1 K/V change over all candidates
    selected_mean_deviation: float  # the same over the recomputed ones


def _recompute_batch(runner: KVRunner, seq_id: int, positions: torch.Tensor) -> AttentionBatch:
    """Recompute tokens at arbitrary positions; each attends to every stored key at or before it."""
    seq = runner.get(seq_id)
    context = seq.slots(0, len(seq), runner.layout.block_size)  # [ctx]
    mask = torch.arange(len(seq))[None, :] <= positions[:, None]  # [n, ctx]
    return AttentionBatch(1, positions.numel(), context[positions], context[None, :], mask[None, None], False)


def _run(runner: KVRunner, seq_id: int, positions: torch.Tensor, num_layers: int) -> None:
    tokens = torch.tensor(runner.get(seq_id).token_ids)[positions]
    batch = _recompute_batch(runner, seq_id, positions)
    runner.model.run_layers(tokens, positions, runner.cache, batch, num_layers)


def blend(runner: KVRunner, seq_id: int, candidate_positions: list[int], fraction: float,
          anchors: list[int] = ()) -> BlendResult:
    """Recompute `fraction` of the candidate positions (0 <= fraction <= 1): the `anchors` among them
    first, then those whose KV deviates most."""
    if not 0.0 <= fraction <= 1.0:
        raise ValueError(f"blend fraction must be in [0, 1], got {fraction}")
    seq = runner.get(seq_id)
    # blocks shared with other sequences must not be rewritten: give this sequence private copies
    for i, block in enumerate(seq.block_table):
        if runner.blocks.ref_counts[block] > 1:
            private = runner.blocks.allocate()
            runner.cache.copy_block(block, private)
            runner.blocks.release(block)
            seq.block_table[i] = private
    positions = torch.tensor(sorted(candidate_positions), dtype=torch.long)
    if positions.numel() == 0 or runner.model.config.num_layers < 2:
        return BlendResult((), positions.numel(), 0.0, 0.0)
    slots = seq.slots(0, len(seq), runner.layout.block_size)[positions]
    k1, v1 = (t.index_select(0, slots).float() for t in runner.cache.layer(1))  # [n, Hkv, D] stale
    _run(runner, seq_id, positions, num_layers=2)  # fresh layer 0-1 K/V for every candidate
    k1n, v1n = (t.index_select(0, slots).float() for t in runner.cache.layer(1))
    deviation = ((k1n - k1).flatten(1).norm(dim=1) + (v1n - v1).flatten(1).norm(dim=1)) / (
        k1n.flatten(1).norm(dim=1) + v1n.flatten(1).norm(dim=1) + 1e-12)  # [n]
    count = int(round(fraction * positions.numel()))
    is_anchor = torch.isin(positions, torch.tensor(list(anchors), dtype=torch.long))  # [n] bool
    others = (~is_anchor).nonzero()[:, 0]  # indices into positions
    order = torch.cat([is_anchor.nonzero()[:, 0], others[deviation[others].argsort(descending=True)]])[:count]
    chosen = positions[order].sort().values
    if count:
        _run(runner, seq_id, chosen, num_layers=runner.model.config.num_layers)
    runner.blocks.tokens_computed += count
    return BlendResult(
        recomputed_positions=tuple(chosen.tolist()),
        candidates=positions.numel(),
        mean_deviation=float(deviation.mean()),
        selected_mean_deviation=float(deviation[order].mean()) if count else 0.0,
    )
