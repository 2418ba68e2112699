"""What a generation returns."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal


@dataclass
class GenerationOutput:
    """Text, token ids and timings of one generation.

    Attributes:
        text: the generated text (special tokens and any stop string removed).
        token_ids: the generated token ids (an end-of-sequence token included if one ended it).
        prompt_token_ids: the prompt as tokenized.
        finish_reason: "eos", "stop" (a stop string) or "length" (max_new_tokens reached).
        ttft_s: seconds from the call to the first generated token.
        prefill_s: seconds spent prefilling the prompt.
        decode_s: seconds spent producing the tokens after the first.
        num_reused_tokens: prompt tokens served from the prefix cache.
    """

    text: str
    token_ids: list[int]
    prompt_token_ids: list[int]
    finish_reason: Literal["eos", "stop", "length"]
    ttft_s: float
    prefill_s: float
    decode_s: float
    num_reused_tokens: int = 0
    seq_id: int | None = field(default=None, repr=False)  # set when the sequence was kept
    kv: Any = field(default=None, repr=False)  # the continued context's KVRef, when an operator kept it

    @property
    def total_s(self) -> float:
        return self.ttft_s + self.decode_s

    @property
    def decode_tokens_per_s(self) -> float:
        """Tokens per second after the first token (0 when only one token was generated)."""
        n = len(self.token_ids) - 1
        return n / self.decode_s if n > 0 and self.decode_s > 0 else 0.0
