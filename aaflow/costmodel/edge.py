"""Closed-form latency of ONE producer -> consumer edge under each strategy (seconds).

Scenario. Producer agent A runs on replica P, consumer B on replica Q; the timeline starts at 0.
A's prompt is C + u tokens, B's prompt is C + O + t (C: the shared static prefix; O: A's output).
Each replica runs one call at a time; every duration comes from a ComputeProfile (P's for A's calls,
Q's for B's) or from the link / memcpy bandwidth. These are the rules, and a discrete-event
simulation of the same setup must agree with them exactly:

1. Generation. A prefill call of L prompt tokens returns the first generated token at its end; each
   further token takes one decode step (batch 1) whose context is the tokens already cached before
   it: L, L + 1, ... So A's k-th token (1-based) exists at a_1 = end of A's last prefill call and
   a_k = a_{k-1} + decode_step_time(1, L + k - 2); A's end is a_O. B likewise: TTFT = end of its last
   prefill call, then output_tokens - 1 decode steps from context C + O + t. B's end is its last token.
2. text-nocache: Q starts at A's end and prefills C + O + t with no context (no reuse).
3. text and recompute: as text-nocache; on the same replica the prefix cache serves C's full blocks
   (PREFIX_BLOCK_TOKENS = 16 tokens each: floor(C / 16) * 16 tokens), so B prefills only the rest,
   with the cached tokens as context.
4. transfer (same model only): P prefills C alone (materialize) from 0; then, on another replica, P
   copies C's KV out (C * kv_bytes_per_token / memcpy_bytes_per_s, P busy; nothing for an in-place
   link), and only then runs A's prefill of u with context C and A's decode. Q fetches the bytes when the copy ends
   (link.transfer_time, Q busy). B prefills O + t with context C at max(A's end, fetch end).
   On the same replica the prefix is forked: no copy, no fetch, 0 bytes moved.
5. stream: Q prefills C at 0 (no context). Chunk i (i = 1..m, m = (O - 1) // chunk_tokens) holds A's
   tokens (i-1)*chunk+1 .. i*chunk; it starts at max(a_{i*chunk}, end of Q's previous call) and is
   prefilled with the context cached so far. The last call starts at max(a_O, end of Q's previous
   call) and prefills the remaining O - m*chunk tokens (1..chunk_tokens of them) plus t.
6. transfer+stream (same model only): C arrives as in transfer (B's first call is the fetch), then
   chunks and the last call as in stream, with context starting at C.
7. Same replica (P is Q): one server, work serializes. A's calls go first, so A's timeline is as on
   its own and all of B's calls run after A's end, back to back (in the order above). B's prefill of C
   in stream is served by the prefix cache as in recompute (A's sequence holds C). B's own prefills
   are what remains. A replica serves one model, so same_replica requires same_model.
8. Different models: "transfer" and "transfer+stream" are absent (only tokens move). They are also
   absent across replicas when no link is given.

bytes_moved counts KV bytes only (C * kv_bytes_per_token for a transfer between replicas; tokens are
free). handoff_s is B's first token minus A's last token.
"""

from __future__ import annotations

from dataclasses import dataclass

from aaflow.common.errors import CostModelError
from aaflow.common.strategies import DEFAULT_BLOCK_TOKENS as PREFIX_BLOCK_TOKENS  # the prefix cache serves whole blocks
from aaflow.costmodel.hardware import ComputeProfile, LinkProfile
from aaflow.costmodel.model_profile import ModelProfile



@dataclass(frozen=True)
class EdgeCase:
    """One producer -> consumer edge, in tokens."""

    context_tokens: int  # C: the shared static prefix (chat header + context) both A and B read first
    upstream_prompt_tokens: int  # u: A's tokens after C
    upstream_output_tokens: int  # O: A's generated tokens, which B's prompt contains after C
    own_tokens: int  # t: B's tokens after A's output
    output_tokens: int  # B's generated tokens
    same_replica: bool = False
    same_model: bool = True
    chunk_tokens: int = 16

    def __post_init__(self) -> None:
        minimum = {"context_tokens": 0, "upstream_prompt_tokens": 0, "upstream_output_tokens": 1,
                   "own_tokens": 0, "output_tokens": 1, "chunk_tokens": 1}
        for name, low in minimum.items():
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise CostModelError(f"EdgeCase.{name} must be an int >= {low}, got {value!r}")
        if self.same_replica and not self.same_model:
            raise CostModelError("EdgeCase: same_replica with different models is impossible (a replica serves "
                                 "one model)")


@dataclass(frozen=True)
class EdgePrediction:
    """Predicted timeline of one strategy on one edge (seconds from 0)."""

    strategy: str
    end_s: float  # B's last token (end to end)
    consumer_ttft_s: float  # B's first token time from 0
    handoff_s: float  # B's first token - A's last token
    bytes_moved: int


def _token_times(first_s: float, prompt_tokens: int, output_tokens: int, profile: ComputeProfile) -> list[float]:
    """Times of a sequence's generated tokens 1..output_tokens (rule 1)."""
    times = [first_s]
    for k in range(1, output_tokens):
        times.append(times[-1] + profile.decode_step_time(1, prompt_tokens + k - 1))
    return times


def _stream_last_call(free_s: float, context: int, tokens_at: list[float], own_tokens: int, chunk: int,
                      consumer: ComputeProfile) -> float:
    """Chunks of A's output, then the remainder plus t (rule 5); returns the end of the last call."""
    out = len(tokens_at)
    chunks = (out - 1) // chunk
    for i in range(1, chunks + 1):
        start = max(tokens_at[i * chunk - 1], free_s)
        free_s = start + consumer.prefill_time(chunk, context)
        context += chunk
    start = max(tokens_at[-1], free_s)
    return start + consumer.prefill_time(out - chunks * chunk + own_tokens, context)


def predict_edge(case: EdgeCase, producer: ComputeProfile, consumer: ComputeProfile, model: ModelProfile,
                 link: LinkProfile | None, memcpy_bytes_per_s: float) -> dict[str, EdgePrediction]:
    """Predicted end, TTFT and handoff of B under each applicable strategy (rules in the module docstring).

    Args:
        producer / consumer: compute profiles of A's and B's replicas (the same one on the same replica).
        model: the model whose KV would move (the shared model; used for transfer bytes only).
        link: the link P -> Q; None disables the transfer strategies across replicas.
        memcpy_bytes_per_s: copy bandwidth on P (KV copied out of the pool before it is sent, unless
            `link.in_place`).
    """
    if memcpy_bytes_per_s <= 0:
        raise CostModelError(f"memcpy_bytes_per_s must be positive, got {memcpy_bytes_per_s!r}")
    c, u, o, t = case.context_tokens, case.upstream_prompt_tokens, case.upstream_output_tokens, case.own_tokens
    b_prompt = c + o + t
    cached = (c // PREFIX_BLOCK_TOKENS) * PREFIX_BLOCK_TOKENS if case.same_replica else 0
    results: dict[str, EdgePrediction] = {}

    def record(strategy: str, a_times: list[float], ttft: float, nbytes: int = 0) -> None:
        end = ttft + consumer.decode_time(case.output_tokens - 1, 1, b_prompt)
        results[strategy] = EdgePrediction(strategy, end, ttft, ttft - a_times[-1], nbytes)

    # A prefills C + u in one call (text, recompute, stream)
    a_plain = _token_times(producer.prefill_time(c + u), c + u, o, producer)
    a_end = a_plain[-1]
    record("text-nocache", a_plain, a_end + consumer.prefill_time(b_prompt))
    record("text", a_plain, a_end + consumer.prefill_time(b_prompt - cached, cached))
    record("recompute", a_plain, a_end + consumer.prefill_time(b_prompt - cached, cached))
    if case.same_replica:
        b_free = a_end + consumer.prefill_time(c - cached, cached)
    else:
        b_free = consumer.prefill_time(c)
    record("stream", a_plain, _stream_last_call(b_free, c, a_plain, t, case.chunk_tokens, consumer))

    if not case.same_model or (link is None and not case.same_replica):
        return results
    # A's prefix C is materialized alone, then shared (fork) or copied out and fetched
    materialized = producer.prefill_time(c)
    if case.same_replica:
        nbytes, a_start, fetched = 0, materialized, 0.0
    else:
        nbytes = c * model.kv_bytes_per_token
        a_start = materialized + link.source_copy_time(nbytes, memcpy_bytes_per_s)
        fetched = a_start + link.transfer_time(nbytes)
    a_shared = _token_times(a_start + producer.prefill_time(u, c), c + u, o, producer)
    a_end = a_shared[-1]
    b_free = a_end if case.same_replica else fetched
    record("transfer", a_shared, max(a_end, b_free) + consumer.prefill_time(o + t, c), nbytes)
    record("transfer+stream", a_shared, _stream_last_call(b_free, c, a_shared, t, case.chunk_tokens, consumer),
           nbytes)
    return results
