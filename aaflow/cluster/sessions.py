"""Step-level generation on a replica, driven by the scheduler one call at a time.

The scheduler (in the driver) owns the schedule: it prefills prompt segments as they become
known (streaming incremental prefill), then advances every running sequence of a replica by
one batched decode step per call. Each call is short, so a replica actor interleaves the work
of many agents, and tokens leave a replica as soon as they are decoded.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from aaflow.engine.sampling import Sampler, SamplingParams
from aaflow.common.errors import KVCapacityError
from aaflow.runtime.backend import SessionLostError
from aaflow.runtime.replies import MixedReply, PrefillReply
from aaflow.cluster.kv_queue import KVQueue


@dataclass
class _Session:
    seq_id: int
    sampler: Sampler | None = None
    generated: list[int] = field(default_factory=list)


class SessionTable(dict):
    """A replica's sessions by id; an unknown id raises `SessionLostError`, not KeyError (the
    replica was restarted, empty, since the session opened)."""

    def __missing__(self, sid: str):
        raise SessionLostError(f"no session {sid!r} on this replica: it was restarted since the session opened "
                               "and its KV is lost; the scheduler recomputes its agents")


class SequenceSessions:
    """A built-in replica's sessions, addressed by a string id, on its engine's sequences."""

    def __init__(self, engine, host, refs, faults) -> None:
        """`refs`: the replica's `RefTable` (a session may continue a ref); `faults`: its
        `FaultInjection` (a decode step may fail on purpose)."""
        self.engine, self.host, self.refs, self.faults = engine, host, refs, faults
        self.table: SessionTable = SessionTable()
        self.queue = KVQueue(engine)  # prompts of runs refused for KV go first

    def _admitted(self, sids: list[str], token_lists, prompt_call):
        """Run a call that prefills prompt tokens of these sessions, keeping the runs' order for KV."""
        self.queue.admit(sids, sum(len(t) for t in token_lists))
        try:
            result = prompt_call()
        except KVCapacityError as exc:
            self.queue.refused(sids, exc)
            raise
        self.queue.served(sids)
        return result

    def session_open(self, sid: str, fork_of: str | None = None) -> int:
        """Start a session, empty or continuing a KVRef of this replica (shared blocks); returns its length."""
        seq = self.engine.fork(self.host.sequence(self.refs.get(fork_of))) if fork_of else self.engine.new_sequence()
        self.table[sid] = _Session(seq)
        return len(self.engine.sequence_tokens(seq))

    def session_prefill(self, sid: str, token_ids: list[int], sampling: SamplingParams | None = None,
                        reuse_prefix: bool = True, chunk_size: int | None = None) -> PrefillReply:
        """Append prompt tokens (incremental prefill). With `sampling`, this was the prompt's last
        segment: the first generated token is sampled and answered as `token`."""
        self.faults.reached("prefill")
        s = self.table[sid]
        t0 = time.perf_counter()
        before = self.engine.stats().tokens_computed
        logits = self._admitted([sid], [token_ids],
                                lambda: self.engine.prefill(s.seq_id, token_ids, chunk_size, reuse_prefix=reuse_prefix))
        computed = self.engine.stats().tokens_computed - before
        return self._reply(s, sampling, logits, computed, len(token_ids) - computed, time.perf_counter() - t0)

    def session_prefill_many(self, requests: list[tuple]) -> list[PrefillReply]:
        """Prefill several sessions' prompt segments together (`KVRunner.prefill_packed`). Each request
        is (sid, token_ids, sampling, reuse_prefix), answered as `session_prefill` would answer it."""
        self.faults.reached("prefill")
        sessions = [self.table[r[0]] for r in requests]
        t0 = time.perf_counter()
        logits, reused = self._admitted(
            [r[0] for r in requests], [r[1] for r in requests],
            lambda: self.engine.prefill_packed([s.seq_id for s in sessions], [list(r[1]) for r in requests],
                                               [bool(r[3]) for r in requests]))  # [n, vocab]
        return self._prefill_answers(sessions, requests, reused, logits, time.perf_counter() - t0)

    def _prefill_answers(self, sessions, requests, reused, logits, seconds: float) -> list[PrefillReply]:
        """Each request's answer, as `session_prefill` gives it; logits: [len(requests), vocab]."""
        return [self._reply(s, r[2], row, len(r[1]) - n, n, seconds)
                for s, r, n, row in zip(sessions, requests, reused, logits)]

    @staticmethod
    def _reply(s: _Session, sampling: SamplingParams | None, logits, computed: int, reused: int,
               seconds: float) -> PrefillReply:
        """The segment's reply; with `sampling` it completed the prompt: the first token is sampled
        from `logits` ([vocab] of the prompt's last token)."""
        if sampling is None:
            return PrefillReply(computed, reused, seconds)
        s.sampler = Sampler(sampling)
        s.generated.append(s.sampler(logits[None])[0])
        return PrefillReply(computed, reused, seconds, s.generated[-1])

    def session_step(self, sids: list[str]) -> list[int]:
        """One batched decode step for these sessions: feed each its last token, sample the next."""
        self.faults.maybe_fail("step")
        sessions = [self.table[sid] for sid in sids]
        logits = self.engine.decode([s.seq_id for s in sessions], [s.generated[-1] for s in sessions])
        return self._sample_next(sessions, logits)

    @staticmethod
    def _sample_next(sessions: list[_Session], logits) -> list[int]:
        """Sample each decoding session's next token from its row of logits [len(sessions), vocab];
        the greedy rows in one argmax (a sampler call per row added up over a large batch)."""
        greedy = logits.argmax(dim=-1).tolist()  # [len(sessions)]
        tokens = []
        for s, row, best in zip(sessions, logits, greedy):
            tokens.append(best if s.sampler.params.temperature == 0.0 else s.sampler(row[None])[0])
            s.generated.append(tokens[-1])
        return tokens

    def session_step_mixed(self, sids: list[str], requests: list[tuple]) -> MixedReply:
        """`session_step(sids)` and `session_prefill_many(requests)` in one forward pass, so the
        weights are read once for both (each decoding session's last token is a 1-token chunk)."""
        self.faults.maybe_fail("step")
        decoding = [self.table[sid] for sid in sids]
        sessions = [self.table[r[0]] for r in requests]
        t0 = time.perf_counter()
        token_lists = [[s.generated[-1]] for s in decoding] + [list(r[1]) for r in requests]
        logits, reused = self._admitted(
            [r[0] for r in requests], [r[1] for r in requests],
            lambda: self.engine.prefill_packed([s.seq_id for s in decoding + sessions], token_lists,
                                               [False] * len(decoding) + [bool(r[3]) for r in requests]))
        seconds, n = time.perf_counter() - t0, len(decoding)  # logits: [n + len(requests), vocab]
        return MixedReply(self._sample_next(decoding, logits[:n]),
                          self._prefill_answers(sessions, requests, reused[n:], logits[n:], seconds))

    def session_close(self, sid: str) -> None:
        """End a session and free its blocks; closing an unknown or closed session does nothing."""
        s = self.table.pop(sid, None)
        if s is not None:
            self.engine.free(s.seq_id)

    def session_count(self) -> int:
        return len(self.table)

    def close_all(self) -> None:
        """Close every session."""
        for sid in list(self.table):
            self.session_close(sid)
