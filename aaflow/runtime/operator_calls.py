"""The calls `af.*` sends a replica beyond the scheduler's (`aaflow.runtime.calls`): fork, generate,
pin and unpin a ref by id. (`af.materialize`, `af.compose`, `af.evict`, `af.free` and
`af.transfer` send the scheduler's own `MaterializeCall`, `ComposeCall`, `EvictCall`, `FreeCall`
and the expose / receive / release calls.)"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from aaflow.runtime.calls import CallKind, NoPromptCall
from aaflow.runtime.replies import RefRecord


@dataclass(frozen=True)
class ForkCall(NoPromptCall):
    """`n` refs sharing ref `ref_id`'s KV (copy-on-write)."""

    kind = CallKind.FORK
    Reply = list[RefRecord]
    ref_id: str
    n: int


@dataclass(frozen=True)
class GenerateCall(NoPromptCall):
    """Continue ref `ref_id`'s context with a prompt and generate (the ref is unchanged); `sampling`:
    the engine's sampling keywords. Answers the engine's `GenerationOutput`."""

    kind = CallKind.GENERATE
    Reply = object
    ref_id: str
    text_or_ids: str | list[int]
    max_new_tokens: int = 32
    sampling: dict[str, Any] = field(default_factory=dict, kw_only=True)

    def keywords(self) -> dict[str, Any]:
        return dict(self.sampling)


@dataclass(frozen=True)
class PinCall(NoPromptCall):
    """Keep ref `ref_id`'s blocks from eviction (for `ttl_s` seconds, or until unpinned)."""

    kind = CallKind.PIN
    Reply = None
    ref_id: str
    ttl_s: float | None = None


@dataclass(frozen=True)
class UnpinCall(NoPromptCall):
    """Let ref `ref_id`'s blocks be evicted again."""

    kind = CallKind.UNPIN
    Reply = None
    ref_id: str
