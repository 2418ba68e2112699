"""Token ids to text as they stream: each new token's text once it is whole."""

from __future__ import annotations


class IncrementalText:
    """Decodes a growing list of token ids; `add` answers the text the new token completes ("" while
    it ends inside a multi-byte character). The pieces add up to decoding all ids at once."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.sent = ""

    def add(self, token_id: int) -> str:
        self.ids.append(token_id)
        text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        if text.endswith("\ufffd"):  # a character split across tokens: wait for the rest
            return ""
        new, self.sent = text[len(self.sent):], text
        return new

    def rest(self) -> str:
        """What `add` held back at the end (a character the output ends inside)."""
        text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        new, self.sent = text[len(self.sent):], text
        return new
