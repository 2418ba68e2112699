"""Text <-> token ids for an engine with a Hugging Face tokenizer and a `ModelConfig`.

Shared by the built-in `Engine` and the vLLM backend, so both read a prompt the same way.
"""

from __future__ import annotations

from typing import Sequence as Seq

from aaflow.errors import PromptError


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
            ids = self.encode(prompt) if prompt else []
        else:
            ids = [int(t) for t in prompt]
            bad = [t for t in ids if not 0 <= t < self.config.vocab_size]
            if bad:
                raise PromptError(f"token ids {bad[:5]} are outside the vocabulary [0, {self.config.vocab_size})")
        if not ids:
            raise PromptError("the prompt is empty: give at least one token of text")
        return ids
