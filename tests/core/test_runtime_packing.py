"""Which queued prefill calls of a replica the scheduler packs into one call."""

from __future__ import annotations

from collections import deque

from aaflow.runtime.calls import CloseCall, PrefillCall
from aaflow.runtime.packing import PACK_MAX_TOKENS, pack_prefills

SYSTEM = list(range(1000, 1000 + 1500))  # a long shared system prompt


def _chunk(sid: str, ids: list[int], reuse: bool = True) -> tuple:
    return PrefillCall(sid, ids, None, reuse), lambda out: None


def _sids(item: tuple) -> list[str]:
    return item[0].sessions


def test_first_prompts_sharing_a_system_prompt_go_in_one_call():
    items = [_chunk(f"b{i}", SYSTEM + [7, i]) for i in range(40)]  # 40 x 1,502 tokens requested
    queue = deque(items[1:])
    packed = pack_prefills(items[0], queue, fresh={f"b{i}" for i in range(40)})
    assert _sids(packed) == [f"b{i}" for i in range(40)] and not queue  # each adds 2 tokens to compute


def test_continuations_and_prompts_without_reuse_count_in_full():
    close = (CloseCall("c"), None)
    queue = deque([_chunk("b1", SYSTEM + [8]), _chunk("b2", SYSTEM + [9], reuse=False), close])
    packed = pack_prefills(_chunk("b0", SYSTEM + [7]), queue, fresh={"b0", "b2"})  # b1 continues a session
    assert _sids(packed) == ["b0"]  # 1,501 more tokens each would pass PACK_MAX_TOKENS
    assert [item[0].sessions[0] for item in queue] == ["b1", "b2", "c"]  # order kept


def test_short_chunks_fill_a_call_up_to_the_cap():
    n = PACK_MAX_TOKENS // 16
    items = [_chunk(f"b{i}", list(range(16))) for i in range(n + 3)]  # streamed chunks: not fresh
    queue = deque(items[1:])
    packed = pack_prefills(items[0], queue, fresh=set())
    assert len(_sids(packed)) == n + 1 and len(queue) == 2  # the first plus PACK_MAX_TOKENS more
