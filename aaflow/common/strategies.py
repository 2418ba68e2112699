"""Strategy names and the constants every part of aaflow that schedules or predicts a run shares.

Imports nothing of aaflow: the workflow DSL, the scheduler, the planner and the cost model's
closed forms all read these.
"""

from __future__ import annotations

STRATEGIES = ("auto", "text", "text-nocache", "recompute", "transfer", "stream", "transfer+stream")
"""What `af.run(strategy=...)` and a per-agent `strategy=` accept; "auto" lets the planner choose.
"text" is plain text passing as a user of a serving engine runs it (each agent prefilled once its
inputs are done, the replica's prefix cache on): the baseline every speedup is quoted against.
"text-nocache" turns the prefix cache off too: only for papers' baselines that need it, labelled so.

Per incoming edge of an agent, the scheduler (`aaflow.runtime.scheduler`):
  text       waits for every input, prefills the whole prompt; the replica's prefix cache may serve
             shared blocks (text passing as on a serving engine): the baseline;
  recompute  the same (the planner's name for it on an edge);
  transfer   materializes the static prefix (chat header + contexts) once, forks it on the same
             replica and moves it to others; the rest is prefilled when the inputs are done;
  stream     prefills the static prefix at once and upstream tokens in chunks while the upstream
             still decodes (position-stable segments only), the remainder at its end;
  transfer+stream  both;
  auto       as transfer+stream for prefixes of at least AUTO_MIN_SHARED_PREFIX tokens, else
             stream (the planner resolves "auto" per agent before a run)."""

TEXT_NOCACHE = "text-nocache"
"""The one strategy that never lets the prefix cache serve a prompt."""

SHARES_PREFIX = ("transfer", "transfer+stream", "auto")
"""Strategies that materialize an agent's static prefix once as KV, fork it on the same replica and
transfer it to others ("auto" only for prefixes of at least AUTO_MIN_SHARED_PREFIX tokens)."""

STREAMS = ("stream", "transfer+stream", "auto")
"""Strategies that prefill upstream tokens while the upstream agent still decodes."""

AUTO_MIN_SHARED_PREFIX = 64
"""Without a plan, "auto" shares a prefix as KV only from this many tokens (a chat header is not worth it)."""

DEFAULT_BLOCK_TOKENS = 16
"""Tokens per KV block of the built-in engine's pool by default; the prefix cache serves whole blocks."""


def shares_prefix(strategy: str, prefix_tokens: int) -> bool:
    """Whether an agent run with `strategy` shares its static prefix of `prefix_tokens` as KV."""
    if strategy == "auto":
        return prefix_tokens >= AUTO_MIN_SHARED_PREFIX
    return strategy in SHARES_PREFIX
