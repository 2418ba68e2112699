"""The generation loop: prefill every prompt, then batched decode until each sequence stops."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from aaflow.engine.outputs import GenerationOutput
from aaflow.engine.sampling import Sampler, SamplingParams

if TYPE_CHECKING:
    from aaflow.engine.engine import Engine


class _Active:
    """One sequence being generated."""

    def __init__(self, seq_id: int, prompt_ids: list[int]) -> None:
        self.seq_id = seq_id
        self.prompt_ids = prompt_ids
        self.generated: list[int] = []
        self.finish_reason: str | None = None
        self.text = ""
        self.reused = 0
        self.prefill_s = 0.0
        self.ttft_s = 0.0


def _check_stop(engine: "Engine", a: _Active, params: SamplingParams, eos: set[int]) -> None:
    last = a.generated[-1]
    if last in eos and not params.ignore_eos:
        a.finish_reason = "eos"
    elif params.stop:
        text = engine.decode_text(a.generated)
        hits = [text.index(s) for s in params.stop if s in text]
        if hits:
            a.text, a.finish_reason = text[: min(hits)], "stop"
            return
    if a.finish_reason is None and len(a.generated) >= params.max_new_tokens:
        a.finish_reason = "length"


def run_generation(engine: "Engine", seq_ids: list[int], prompts: list[list[int]], params: SamplingParams,
                   chunk_size: int | None, start: float, keep: bool) -> list[GenerationOutput]:
    """Generate for each (sequence, prompt) pair; `start` is when the caller's request began."""
    sampler = Sampler(params)
    eos = set(engine.config.eos_token_ids)
    if engine.tokenizer.eos_token_id is not None:
        eos.add(engine.tokenizer.eos_token_id)
    active = [_Active(s, p) for s, p in zip(seq_ids, prompts)]
    for a in active:
        t0 = time.perf_counter()
        before = engine.stats().tokens_reused
        logits = engine.prefill(a.seq_id, a.prompt_ids, chunk_size)  # [vocab]
        a.reused = engine.stats().tokens_reused - before
        a.generated.append(sampler(logits[None])[0])
        now = time.perf_counter()
        a.prefill_s, a.ttft_s = now - t0, now - start
        _check_stop(engine, a, params, eos)
    decode_start = time.perf_counter()
    running = [a for a in active if a.finish_reason is None]
    while running:
        logits = engine.decode([a.seq_id for a in running], [a.generated[-1] for a in running])  # [B, V]
        for a, tok in zip(running, sampler(logits)):
            a.generated.append(tok)
            _check_stop(engine, a, params, eos)
        running = [a for a in running if a.finish_reason is None]
    decode_s = time.perf_counter() - decode_start
    outputs = []
    for a in active:
        text = a.text if a.finish_reason == "stop" else engine.decode_text(a.generated)
        outputs.append(GenerationOutput(
            text=text, token_ids=a.generated, prompt_token_ids=a.prompt_ids,
            finish_reason=a.finish_reason, ttft_s=a.ttft_s, prefill_s=a.prefill_s,
            decode_s=decode_s if len(a.generated) > 1 else 0.0, num_reused_tokens=a.reused,
            seq_id=a.seq_id if keep else None,
        ))
    return outputs
