"""Text <-> token ids for an engine with a Hugging Face tokenizer and a `ModelConfig`.

Shared by the built-in `Engine` and the vLLM backend, so both read a prompt the same way.
"""

from __future__ import annotations

import operator
from collections.abc import Iterable
from typing import Sequence as Seq

from aaflow.common.errors import PromptError


class PromptText:
    """Mixin: needs `self.tokenizer` (Hugging Face) and `self.config` (`ModelConfig`)."""

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=True)

    def decode_text(self, token_ids: Seq[int]) -> str:
        return self.tokenizer.decode(list(token_ids), skip_special_tokens=True)

    def chat_prompt(self, user: str, system: str | None = None) -> str:
        """The model's chat template applied to one user turn, ready for generation."""
        messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": user}]
        return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)

    def prompt_ids(self, prompt: str | Seq[int]) -> list[int]:
        """Token ids of a text or an id list; ids outside the vocabulary and empty prompts raise `PromptError`."""
        if isinstance(prompt, str):
            ids = self._encode_text(prompt) if prompt else []
        else:
            if isinstance(prompt, (bytes, bytearray)) or not isinstance(prompt, Iterable):
                raise PromptError(f"a prompt must be text or a list of token ids, got {type(prompt).__name__}")
            ids = [_token_id(t) for t in prompt]
            bad = [t for t in ids if not 0 <= t < self.config.vocab_size]
            if bad:
                raise PromptError(f"token ids {bad[:5]} are outside the vocabulary [0, {self.config.vocab_size})")
        if not ids:
            raise PromptError("the prompt is empty: give at least one token of text")
        return ids

    def _encode_text(self, text: str) -> list[int]:
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as exc:  # lone surrogates: the tokenizer would fail untyped
            raise PromptError(f"the prompt is not valid unicode text ({exc.reason} at character {exc.start}); "
                              "remove unpaired surrogates") from exc
        return self.encode(text)


def _token_id(token) -> int:
    """An integer token id (Python, numpy or 0-d torch integer); `PromptError` for anything else."""
    if not isinstance(token, bool):
        try:
            return operator.index(token)
        except TypeError:
            pass
    raise PromptError(f"token ids must be integers, got {token!r} ({type(token).__name__}); pass text or a list of ints")
