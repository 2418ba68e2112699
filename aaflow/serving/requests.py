"""OpenAI-compatible request bodies, checked, and the one-agent workflow each becomes.

A chat request's messages become one agent: its system prompt, its earlier turns (`history`) and
its last user message, rendered by the model's chat template and tokenized whole, as vLLM does
(`aaflow.serving.workflows`). A completions request's prompt is sent as the user message of a
chat without a system prompt (aaflow's agents always speak through the chat template). Fields
the endpoint does not know are ignored, as OpenAI-compatible servers do; fields it knows but
cannot honour (`n` > 1, `stop`, `logprobs`, tools) are refused with a 400 naming them.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from aaflow.common.errors import AAFlowError


class RequestError(AAFlowError, ValueError):
    """A request the endpoint refuses: `status` is its HTTP status, `param` the field at fault."""

    def __init__(self, message: str, param: str | None = None, status: int = 400) -> None:
        super().__init__(message)
        self.param, self.status = param, status


class AgentHintsBody(BaseModel):
    """`agent_hints`: the request's place in a workflow (SGLang RFC #24656's name; aaflow reads
    these four fields and ignores the others)."""

    model_config = ConfigDict(extra="ignore")
    workflow_id: str | None = None
    agent_id: str | None = None
    reads: list[str] = Field(default_factory=list)  # agents of the workflow whose answers this prompt contains
    ttl_s: float | None = Field(default=None, ge=0)  # keep the leading context this long after the request


class Message(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: str
    content: str | list[dict[str, Any]] | None = None


class _Sampling(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model: str
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0)
    top_p: float | None = Field(default=None, gt=0, le=1)
    seed: int | None = None
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    n: int = 1
    stop: str | list[str] | None = None
    logprobs: Any = None
    ignore_eos: bool = False  # vLLM's extension: generate exactly max_tokens
    agent_hints: AgentHintsBody | None = None

    def refuse_unsupported(self) -> None:
        if self.n != 1:
            raise RequestError("n must be 1: aaflow generates one choice per request", "n")
        if self.stop:
            raise RequestError("stop sequences are not supported; the model stops at its end-of-sequence token "
                               "or max_tokens", "stop")
        if self.logprobs:
            raise RequestError("logprobs are not supported", "logprobs")

    @property
    def include_usage(self) -> bool:
        return bool((self.stream_options or {}).get("include_usage"))


class ChatRequest(_Sampling):
    messages: list[Message]
    tools: list | None = None

    def refuse_unsupported(self) -> None:
        super().refuse_unsupported()
        if self.tools:
            raise RequestError("tools are not supported", "tools")


class CompletionRequest(_Sampling):
    prompt: str | list[str]


def text_of(content: str | list[dict[str, Any]] | None, where: str) -> str:
    """A message's text: a string, or the text parts of a content list."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    texts = []
    for part in content:
        if part.get("type") != "text" or not isinstance(part.get("text"), str):
            raise RequestError(f"{where}: only text content parts are supported, got type {part.get('type')!r}",
                               "messages")
        texts.append(part["text"])
    return "".join(texts)


def conversation(messages: list[Message]) -> tuple[str | None, list[tuple[str, str]], str]:
    """(system prompt, earlier turns, last user message) of a chat's messages."""
    if not messages:
        raise RequestError("messages must not be empty", "messages")
    system = None
    rest = list(messages)
    if rest[0].role in ("system", "developer"):
        system = text_of(rest.pop(0).content, "messages[0]")
    if not rest or rest[-1].role != "user":
        raise RequestError("the last message must have role 'user' (aaflow answers a user turn)", "messages")
    turns = []
    for i, message in enumerate(rest[:-1], start=len(messages) - len(rest)):
        if message.role not in ("user", "assistant"):
            raise RequestError(f"messages[{i}]: role {message.role!r} is not supported here (system first, then "
                               "user and assistant turns)", "messages")
        turns.append((message.role, text_of(message.content, f"messages[{i}]")))
    user = text_of(rest[-1].content, f"messages[{len(messages) - 1}]")
    if not user:
        raise RequestError("the last user message is empty", "messages")
    return system, turns, user


def sampling_options(body: _Sampling, default_max_tokens: int) -> dict:
    """The agent's settings from a request (OpenAI's defaults where it says nothing: temperature 1)."""
    return {"max_tokens": body.max_completion_tokens or body.max_tokens or default_max_tokens,
            "temperature": 1.0 if body.temperature is None else body.temperature,
            "top_p": 1.0 if body.top_p is None else body.top_p, "seed": body.seed, "ignore_eos": body.ignore_eos}
