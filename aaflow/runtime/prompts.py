"""Canonical prompt token ids: every strategy prefills exactly the same tokens for an agent.

An agent's prompt is a list of segments: token-id lists known before the run (chat header,
system prompt, contexts, literal strings) and references to upstream agents, whose segment is
the upstream's generated token ids (an end-of-sequence token removed). Parts are joined by a
blank line; the chat template's user/assistant framing wraps them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Union

from aaflow.errors import WorkflowError
from aaflow.workflow.graph import AgentNode, ContextNode, Ref, Workflow

_PLACEHOLDER = "\u2063AAFLOW_PROMPT\u2063"


@dataclass(frozen=True)
class AgentInput:
    """A prompt segment produced by another agent."""

    agent: str


Segment = Union[tuple[int, ...], AgentInput]


class PromptBuilder:
    """Tokenizes prompt pieces for one model (a Hugging Face tokenizer with a chat template)."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.separator = tuple(self._ids("\n\n"))

    def _ids(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False)

    def frame(self, system: str | None) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """Token ids before and after the user message in the model's chat template."""
        messages = ([{"role": "system", "content": system}] if system else []) + [
            {"role": "user", "content": _PLACEHOLDER}]
        text = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        head, tail = text.split(_PLACEHOLDER)
        return tuple(self._ids(head)), tuple(self._ids(tail))

    def segments(self, wf: Workflow, agent: AgentNode) -> list[Segment]:
        """The agent's prompt as segments. The first is the shareable prefix: the chat header and
        the leading contexts, which other agents may share; adjacent known segments after it merge."""
        head, tail = self.frame(agent.system)
        out: list[Segment] = [head]
        shared = True
        for i, part in enumerate(agent.prompt):
            is_context = isinstance(part, Ref) and isinstance(wf.nodes[part.name], ContextNode)
            shared = shared and is_context
            if shared:
                out[0] = out[0] + (self.separator if i else ()) + tuple(self._ids(wf.nodes[part.name].text))
                continue
            if i:
                out.append(self.separator)
            if isinstance(part, str):
                out.append(tuple(self._ids(part)))
            elif isinstance(part, Ref) and isinstance(wf.nodes[part.name], ContextNode):
                out.append(tuple(self._ids(wf.nodes[part.name].text)))
            elif isinstance(part, Ref) and isinstance(wf.nodes[part.name], AgentNode):
                out.append(AgentInput(part.name))
            else:
                raise WorkflowError(f"agent {agent.name!r}: KV operator nodes in prompts are declared by the DSL "
                                    "but not executed by the runtime yet; use contexts and agent outputs")
        out.append(tail)
        merged: list[Segment] = [out[0]]
        for seg in out[1:]:
            if len(merged) > 1 and isinstance(seg, tuple) and isinstance(merged[-1], tuple):
                merged[-1] = merged[-1] + seg
            else:
                merged.append(seg)
        return merged


def static_prefix(segments: list[Segment]) -> tuple[int, ...]:
    """The shareable prefix: chat header and leading contexts (never the whole prompt)."""
    return segments[0]


def resolve(segments: list[Segment], outputs: dict[str, list[int]]) -> list[int]:
    """The full prompt once every upstream output is known."""
    ids: list[int] = []
    for seg in segments:
        ids.extend(outputs[seg.agent] if isinstance(seg, AgentInput) else seg)
    return ids
