"""Sampling parameters (validated) and the token sampler."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from aaflow.common.errors import SamplingError


@dataclass(frozen=True)
class SamplingParams:
    """How to pick the next token. temperature 0 means greedy (the default)."""

    max_new_tokens: int = 32
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()  # strings that end generation (not included in the text)
    ignore_eos: bool = False  # keep going past end-of-sequence tokens (benchmarks)

    def __post_init__(self) -> None:
        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
            raise SamplingError(f"max_new_tokens must be an int >= 1, got {self.max_new_tokens!r}")
        if not (isinstance(self.temperature, (int, float)) and 0.0 <= self.temperature < float("inf")):
            raise SamplingError(f"temperature must be a finite number >= 0 (0 = greedy), got {self.temperature!r}")
        if not (isinstance(self.top_p, (int, float)) and 0.0 < self.top_p <= 1.0):
            raise SamplingError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if self.seed is not None and not isinstance(self.seed, int):
            raise SamplingError(f"seed must be an int or None, got {self.seed!r}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise SamplingError(f"stop must be non-empty strings, got {self.stop!r}")


class Sampler:
    """Picks tokens from logits; one generator per request so seeded runs repeat."""

    def __init__(self, params: SamplingParams) -> None:
        self.params = params
        self.generator = torch.Generator()
        if params.seed is not None:
            self.generator.manual_seed(params.seed)

    def __call__(self, logits: torch.Tensor) -> list[int]:  # logits: [B, vocab] float32 -> B token ids
        p = self.params
        if p.temperature == 0.0:
            return logits.argmax(dim=-1).tolist()
        probs = torch.softmax(logits / p.temperature, dim=-1)  # [B, V]
        if p.top_p < 1.0:
            sorted_probs, order = probs.sort(dim=-1, descending=True)
            keep = sorted_probs.cumsum(dim=-1) - sorted_probs < p.top_p  # always keeps the top token
            sorted_probs = sorted_probs * keep
            probs = torch.zeros_like(probs).scatter_(-1, order, sorted_probs)
        return torch.multinomial(probs, 1, generator=self.generator).squeeze(-1).tolist()
