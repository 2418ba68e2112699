"""Canonical prompt token ids: every strategy prefills exactly the same tokens for an agent.

An agent's prompt is a list of segments: token-id lists known before the run (chat header,
system prompt, contexts, literal strings) and references to upstream agents, whose segment is
the upstream's generated token ids (an end-of-sequence token removed). Parts are joined by a
blank line; the chat template's user/assistant framing wraps them. A `rendered` agent's parts
are its whole prompt already: joined as they are, with no framing (`PromptBuilder.chat` gives a
chat turn's ids so, as the model's tokenizer gives them for the whole rendered text).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Union

from aaflow.common.errors import WorkflowError
from aaflow.workflow.graph import AgentNode, ContextNode, KVOpNode, Ref, Workflow

_PLACEHOLDER = "\u2063AAFLOW_PROMPT\u2063"
FRAMES_KEPT = 1024  # chat frames (system prompt + earlier turns) a builder remembers
TEXTS_KEPT = 8192  # tokenized texts a builder remembers


@dataclass(frozen=True)
class AgentInput:
    """A prompt segment produced by another agent."""

    agent: str


Segment = Union[tuple[int, ...], AgentInput]


class PromptBuilder:
    """Tokenizes prompt pieces for one model (a Hugging Face tokenizer with a chat template)."""

    def __init__(self, tokenizer, lock: threading.Lock | None = None) -> None:
        self.tokenizer = tokenizer
        self._lock = lock or threading.Lock()  # a fast tokenizer is not safe to call from two threads at once
        self._memo: dict[str, tuple[int, ...]] = {}  # a context read by many agents is tokenized once
        self._frames: dict[tuple, tuple[tuple[int, ...], tuple[int, ...]]] = {}
        self.separator = self.ids("\n\n")
        self.vocab_size = len(tokenizer)  # ids a token-id context may hold

    def ids(self, text: str) -> tuple[int, ...]:
        """The token ids of `text` (no special tokens), each text tokenized once per builder."""
        ids = self._memo.get(text)
        if ids is None:
            with self._lock:
                if len(self._memo) > TEXTS_KEPT:  # a long-lived server sees ever new texts
                    self._memo.clear()
                ids = self._memo[text] = tuple(self.tokenizer.encode(text, add_special_tokens=False))
        return ids

    def frame(self, system: str | None, history: tuple[tuple[str, str], ...] = ()) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """Token ids before and after the user message in the model's chat template (after the
        system prompt and the conversation's earlier turns)."""
        key = (system, history)
        if key not in self._frames:
            if len(self._frames) > FRAMES_KEPT:
                self._frames.clear()
            self._frames[key] = self._frame(system, history)
        return self._frames[key]

    def _frame(self, system: str | None, history: tuple[tuple[str, str], ...]) -> tuple[tuple[int, ...], tuple[int, ...]]:
        with self._lock:
            text = self.tokenizer.apply_chat_template(_messages(system, history, _PLACEHOLDER), tokenize=False,
                                                      add_generation_prompt=True)
        head, tail = text.split(_PLACEHOLDER)
        return self.ids(head), self.ids(tail)

    def chat(self, system: str | None, history: tuple[tuple[str, str], ...], user: str) -> tuple[tuple[int, ...], int]:
        """A chat turn's prompt as the model's tokenizer gives it whole, and its header's length.

        The ids are `apply_chat_template(messages, tokenize=True, add_generation_prompt=True)`'s:
        the template rendered, then tokenized as one text (as vLLM's chat endpoint does). The
        header is as many leading ids as the template's text before the user message tokenizes
        to alone, as far as they agree with the whole (the user message's first characters may
        merge with the header's last token)."""
        with self._lock:
            ids = tuple(self.tokenizer.apply_chat_template(_messages(system, history, user), tokenize=True,
                                                           add_generation_prompt=True, return_dict=True)["input_ids"])
        head, _ = self.frame(system, history)
        header = next((i for i, (a, b) in enumerate(zip(head, ids)) if a != b), min(len(head), len(ids)))
        return ids, header

    def segments(self, wf: Workflow, agent: AgentNode) -> list[Segment]:
        """The agent's prompt as segments. The first is the shareable prefix: the chat header and
        the leading contexts (for a `rendered` agent, its leading contexts short of its last part),
        which other agents may share; adjacent known segments after it merge."""
        leaves = prompt_leaves(wf, agent)
        shared = _shared_leaves(agent, leaves)
        head, tail = ((), ()) if agent.rendered else self.frame(agent.system, agent.history)
        separator = () if agent.rendered else self.separator
        out: list[Segment] = [head]
        for i, part in enumerate(leaves):
            if i < shared:
                out[0] = out[0] + (separator if i else ()) + self._known(part)
                continue
            if i:
                out.append(separator)
            out.append(AgentInput(part.name) if isinstance(part, AgentNode) else self._known(part))
        out.append(tail)
        merged: list[Segment] = [out[0]]
        for seg in out[1:]:
            if seg == ():
                continue
            if len(merged) > 1 and isinstance(seg, tuple) and isinstance(merged[-1], tuple):
                merged[-1] = merged[-1] + seg
            else:
                merged.append(seg)
        return merged

    def prefix_part_lengths(self, wf: Workflow, agent: AgentNode) -> list[int]:
        """How the static prefix splits into its contexts (as `segments` joins them): the chat
        header with the first context, then each further context with the separator before it."""
        leaves = prompt_leaves(wf, agent)
        head = () if agent.rendered else self.frame(agent.system, agent.history)[0]
        separator = () if agent.rendered else self.separator
        return [(len(separator) if i else len(head)) + len(self._known(part))
                for i, part in enumerate(leaves[:_shared_leaves(agent, leaves)])]

    def _known(self, part: Union[str, ContextNode]) -> tuple[int, ...]:
        """The ids of a literal string or a context; `WorkflowError` for a token id the tokenizer lacks."""
        if isinstance(part, str):
            return self.ids(part)
        if part.token_ids is None:
            return self.ids(part.text)
        if max(part.token_ids) >= self.vocab_size:
            raise WorkflowError(f"context {part.name!r}: token id {max(part.token_ids)} is not in the model's "
                                f"tokenizer, whose ids run up to {self.vocab_size - 1}")
        return part.token_ids


def _messages(system: str | None, history: tuple[tuple[str, str], ...], user: str) -> list[dict]:
    """A chat turn as chat-template messages: the system prompt if any, earlier turns, the user message."""
    return ([{"role": "system", "content": system}] if system is not None else []) + [
        {"role": role, "content": content} for role, content in history] + [{"role": "user", "content": user}]


def _shared_leaves(agent: AgentNode, leaves: list) -> int:
    """How many of the agent's leading prompt parts make its static prefix: its leading contexts,
    short of its last part for a `rendered` agent (its prompt has no chat tail after them)."""
    count = next((i for i, leaf in enumerate(leaves) if not isinstance(leaf, ContextNode)), len(leaves))
    return min(count, len(leaves) - 1) if agent.rendered else count


def prompt_leaves(wf: Workflow, agent: AgentNode) -> list[Union[str, ContextNode, AgentNode]]:
    """The agent's prompt parts with KV operator nodes expanded into what they carry: a fork,
    transfer or compose of contexts / agent outputs reads as those parts, in order."""
    leaves: list[Union[str, ContextNode, AgentNode]] = []

    def expand(part) -> None:
        node = wf.nodes[part.name] if isinstance(part, Ref) else part
        if isinstance(node, KVOpNode):
            if node.op == "evict":
                raise WorkflowError(f"agent {agent.name!r}: evict node {node.name!r} cannot be a prompt part; "
                                    "it only declares when KV may be dropped")
            for name in node.inputs:
                expand(Ref(name, "kvop"))
        else:
            leaves.append(node)

    for part in agent.prompt:
        expand(part)
    return leaves


def static_prefix(segments: list[Segment]) -> tuple[int, ...]:
    """The shareable prefix: chat header and leading contexts (never the whole prompt)."""
    return segments[0]


def reorder_by_completion(segments: list[Segment], start: int, finished: list[str]) -> list[Segment]:
    """For an agent with `unordered=True`: the upstream segments from index `start` on, refilled
    in completion order (`finished`, earliest first) followed by the unfinished ones in their
    declared order. Only upstream segments move; the text between them stays in place."""
    slots = [i for i in range(start, len(segments)) if isinstance(segments[i], AgentInput)]
    names = [segments[i].agent for i in slots]
    ordered = [n for n in finished if n in names] + [n for n in names if n not in finished]
    out = list(segments)
    for slot, name in zip(slots, ordered):
        out[slot] = AgentInput(name)
    return out


def resolve(segments: list[Segment], outputs: dict[str, list[int]]) -> list[int]:
    """The full prompt once every upstream output is known."""
    ids: list[int] = []
    for seg in segments:
        ids.extend(outputs[seg.agent] if isinstance(seg, AgentInput) else seg)
    return ids
