"""A replica on the simulated clock: what a call would take and answer, from a compute profile.

It keeps what decides the cost of the next call: each session's KV length, the prefix cache
(whole blocks of the prompts prefilled so far, a fork of a ref's continuing it as the engine's
`PrefixReuse` does), the shared refs. Call costs: every call pays
`overhead_s`; a prefill of n new tokens after c held ones costs `prefill_time(n, c)`; a packed
prefill pays the overhead once and the fixed prefill term once per forward pass (a second pass
where a member reuses what an earlier member computes); a decode step `decode_step_time(batch,
mean context)`; exposing a prefix `link.source_copy_time` on the source, receiving it
`link.transfer_time(nbytes)` on the destination.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Callable, NamedTuple

from aaflow.runtime.packing import common_prefix_len
from aaflow.runtime.replies import Exposure, PrefillReply, Received, StepsReply

Outcome = tuple[float, object, Callable[[], None] | None]  # seconds, value, state change at its end


class SimRecord(NamedTuple):
    """What `materialize` / `receive` / `compose` answer: the new ref's id and the tokens computed."""

    id: str
    computed: int = 0
    fidelity: object = None


class SimShape(NamedTuple):
    """A transfer's size."""

    nbytes: int


@dataclass
class _Session:
    tokens: int = 0  # KV tokens held
    key: object = None  # what its shared blocks are counted under: their first block
    shared: int = 0  # of its tokens, those in blocks shared with other sessions or refs
    ids: list[int] | None = None  # its token ids while known (a ref's and its prompt's; None once it decoded)


class _Ledger:
    """Live KV tokens, kept as calls end: sessions' own tokens, and per shared prefix (counted under
    its first block) how many holders hold how many tokens of it; each prefix counts once, at its
    longest."""

    def __init__(self) -> None:
        self.own = 0
        self.shared: dict[object, dict[int, int]] = {}  # key -> {tokens held: holders}
        self.longest: dict[object, int] = {}  # key -> the most tokens held
        self.total_longest = 0

    def share(self, key, tokens: int, holders: int = 1) -> None:
        counts = self.shared.setdefault(key, {})
        counts[tokens] = counts.get(tokens, 0) + holders
        before = self.longest.get(key, 0)
        if counts[tokens] and tokens > before:
            self.longest[key] = tokens
        elif not counts[tokens]:
            del counts[tokens]
            if tokens == before:
                self.longest[key] = max(counts, default=0)
        self.total_longest += self.longest.get(key, 0) - before

    def tokens(self) -> int:
        return self.own + self.total_longest


class _Node:
    """A point in the prefix cache: the cached continuations from here, by their first block."""

    __slots__ = ("children",)

    def __init__(self) -> None:
        self.children: dict[tuple, _Edge] = {}


class _Edge:
    """A run of whole blocks (their token ids) cached by call number `call`, leading to `child`."""

    __slots__ = ("label", "call", "child")

    def __init__(self, label: list[int], call: int, child: _Node | None = None) -> None:
        self.label, self.call, self.child = label, call, child or _Node()

    def split(self, at: int, block: int) -> None:
        """Cut the run after `at` tokens (a whole number of blocks > 0)."""
        rest = _Edge(self.label[at:], self.call, self.child)
        self.label, self.child = self.label[:at], _Node()
        self.child.children[tuple(rest.label[:block])] = rest


class SimReplica:
    """One replica's simulated state and call costs (token ids are only compared, never run)."""

    def __init__(self, name: str, compute, kv_bytes_per_token: int, block_tokens: int, overhead_s: float) -> None:
        self.name, self.compute, self.kv_bytes_per_token = name, compute, kv_bytes_per_token
        self.block, self.overhead = block_tokens, overhead_s
        self.sessions: dict[str, _Session] = {}
        self.refs: dict[str, tuple[list[int], object]] = {}  # ref id -> (token ids, what its forks share)
        self.cache = _Node()  # the prefix cache: a radix tree of whole blocks
        self.calls = 0  # calls evaluated (stamps the blocks each adds to the cache)
        self.ledger = _Ledger()
        self.computed = 0  # prompt tokens computed here

    # --- prefix cache --------------------------------------------------------------------
    def _walk(self, ids: list[int], call: int) -> tuple[int, bool]:
        """Look `ids` up in the prefix cache and add its whole blocks: the tokens of its leading
        blocks that were cached, and whether the last of those it can reuse was added by the same
        call `call` (a packed call computes it in an earlier forward pass)."""
        b = self.block
        full = len(ids) // b * b
        node, pos, matched = self.cache, 0, []  # matched: (end, stamp) per edge followed
        while pos < full:
            key = tuple(ids[pos:pos + b])
            edge = node.children.get(key)
            if edge is None:
                node.children[key] = _Edge(ids[pos:full], call)
                break
            label = edge.label
            same = common_prefix_len(label, ids[pos:pos + len(label)]) // b * b
            matched.append((pos + same, edge.call))
            pos += same
            if same < len(label) and pos < full:  # diverges inside the edge: split it there
                edge.split(same, b)
                edge.child.children[tuple(ids[pos:pos + b])] = _Edge(ids[pos:full], call)
                break
            node = edge.child
        hit = min(pos, (len(ids) - 1) // b * b)
        return pos, hit > 0 and next(stamp for end, stamp in matched if end >= hit) == call

    def _prefill(self, sid: str | None, ids: list[int], reuse: bool, call: int) -> tuple[float, int, object, bool]:
        """Cost of prefilling `ids` into session `sid` (None: a new ref) in call number `call`:
        seconds, tokens served by the prefix cache, what its shared blocks are counted under
        (their first block), whether the hit is on blocks an earlier member of the call computes."""
        session = self.sessions[sid] if sid is not None else None
        held = session.tokens if session is not None else 0
        hit, fresh_hit = 0, False
        if held == 0 or (reuse and session.ids is not None):  # a fork of a ref continues from the cache too
            whole = session.ids + list(ids) if held else ids
            common, fresh_hit = self._walk(whole, call)
            hit = max(0, min(common, (len(whole) - 1) // self.block * self.block) - held) if reuse else 0
            fresh_hit = fresh_hit and hit > 0
        self.computed += len(ids) - hit
        seconds = self.overhead + self.compute.prefill_time(len(ids) - hit, held + hit)
        return seconds, hit, tuple(ids[:self.block]), fresh_hit

    # --- calls ---------------------------------------------------------------------------
    def session_open(self, sid: str, fork_of: str | None) -> Outcome:
        ids, key = self.refs[fork_of] if fork_of else ((), None)

        def apply() -> None:
            self.sessions[sid] = _Session(len(ids), key, len(ids), list(ids))
            if ids:
                self.ledger.share(key, len(ids))

        return self.overhead, len(ids), apply

    def materialize(self, ids: list[int], ref_id: str) -> Outcome:
        self.calls += 1
        seconds, hit, key, _ = self._prefill(None, ids, True, self.calls)
        return seconds, SimRecord(ref_id, len(ids) - hit), lambda: self._add_ref(ref_id, ids, key)

    def compose(self, ref_ids: list[str], mode: str, r: float, ref_id: str) -> Outcome:
        """The parts' tokens as one ref; blend recomputes `r` of the tokens after the first part."""
        parts = [self.refs[i][0] for i in ref_ids]
        ids = [t for part in parts for t in part]
        recomputed = int(r * (len(ids) - len(parts[0]))) if mode == "blend" else 0
        seconds = self.overhead + self.compute.prefill_time(recomputed, len(ids) - recomputed)
        return seconds, SimRecord(ref_id, recomputed), lambda: self._add_ref(ref_id, ids, ref_id)

    def _add_ref(self, ref_id: str, ids: list[int], key) -> None:
        self.refs[ref_id] = (ids, key if len(ids) >= self.block else ref_id)
        self.ledger.share(self.refs[ref_id][1], len(ids))

    def prefill_many(self, requests: list, first_token: Callable[[], int]) -> tuple[float, list, Callable]:
        """Prefill requests in order (a member may hit blocks an earlier member computes); one call."""
        self.calls += 1
        outcomes = [self._prefill(r.sid, r.token_ids, r.reuse_prefix, self.calls) for r in requests]
        passes = 2 if any(fresh_hit for *_, fresh_hit in outcomes) else 1
        n = len(requests)
        seconds = (sum(o[0] for o in outcomes) - (n - 1) * self.overhead - (n - passes) * self.compute.prefill_fixed_s
                   + (n - 1) * self.compute.prefill_s_per_member)
        answers = [PrefillReply(len(r.token_ids) - hit, hit, seconds, None if r.sampling is None else first_token())
                   for r, (_, hit, _, _) in zip(requests, outcomes)]

        def apply() -> None:
            for r, (_, hit, key, _) in zip(requests, outcomes):
                s = self.sessions[r.sid]
                if s.tokens == 0 and r.reuse_prefix:
                    s.key, s.shared = key, (hit or len(r.token_ids) // self.block * self.block)
                    if s.shared:
                        self.ledger.share(key, s.shared)
                        self.ledger.own -= s.shared
                s.tokens += len(r.token_ids)
                if s.ids is not None:
                    s.ids.extend(r.token_ids)
                self.ledger.own += len(r.token_ids)

        return seconds, answers, apply

    def step(self, sids: list[str], next_token: Callable[[], int]) -> Outcome:
        """One decode step: a group of one, with its one token per session."""
        seconds, out, apply = self.steps(sids, 1, [(1, ())] * len(sids), next_token)
        return seconds, [row[0] for row in out.tokens], apply

    def steps(self, sids: list[str], steps: int, stops: list[tuple], next_token: Callable[[], int]) -> Outcome:
        """A group of decode steps (`aaflow.cluster.step_group_runner.run_steps`): one call overhead; simulated
        tokens are never end-of-sequence, so it ends at its step count or the first budget."""
        sessions = [self.sessions[s] for s in sids]  # the same objects at the call's end: one call at a time
        count = max(1, min([steps] + [budget for budget, _ in stops]))
        context = sum([s.tokens for s in sessions]) / max(1, len(sids))
        seconds = [self.compute.decode_step_time(len(sids), context + i) for i in range(count)]
        ends = list(itertools.accumulate(seconds))

        def apply() -> None:
            for s in sessions:
                s.tokens += count
                s.ids = None  # its generated ids are not tracked: later segments are not looked up
            self.ledger.own += len(sids) * count

        tokens = [[next_token() for _ in range(count)] for _ in sids]
        return self.overhead + ends[-1], StepsReply(tokens, ends), apply

    def expose(self, ref_id: str, link, memcpy_bytes_per_s: float) -> Outcome:
        """The handle is the ref's token ids (the receiver caches them)."""
        ids = self.refs[ref_id][0]
        nbytes = len(ids) * self.kv_bytes_per_token
        return self.overhead + link.source_copy_time(nbytes, memcpy_bytes_per_s), Exposure(ids, SimShape(nbytes), None), None

    def receive(self, ids: list[int], shape: SimShape, ref_id: str, link) -> Outcome:
        def apply() -> None:  # the received blocks enter the prefix cache too
            self.calls += 1
            self._walk(ids, self.calls)
            self._add_ref(ref_id, ids, tuple(ids[:self.block]))

        return self.overhead + link.transfer_time(shape.nbytes), Received(SimRecord(ref_id), shape), apply

    def live_kv_bytes(self) -> int:
        """KV bytes held now: each session's own tokens, plus each shared prefix once (the longest
        of those starting with the same block)."""
        return self.ledger.tokens() * self.kv_bytes_per_token

    def session_close(self, sid: str) -> Outcome:
        def apply() -> None:
            s = self.sessions.pop(sid, None)
            if s is not None:
                self.ledger.own -= s.tokens - s.shared
                if s.shared:
                    self.ledger.share(s.key, s.shared, -1)

        return self.overhead, None, apply

    def free(self, ref_id: str) -> Outcome:
        def apply() -> None:
            ids, key = self.refs.pop(ref_id)
            self.ledger.share(key, len(ids), -1)

        return self.overhead, None, apply
