"""LangGraph on aaflow: a LangChain chat model that talks to `aaflow serve` with workflow hints.

Replace `ChatOpenAI(...)` by `AAFlowChat(base_url="http://127.0.0.1:8000/v1", model=...)` and an
existing LangGraph `StateGraph` runs on an aaflow deployment. Each call carries
`agent_hints` from the node it runs in: `agent_id` is the node's name (with the task's index for
a `Send` fan-out, `researcher[2]`), `workflow_id` the graph run's thread (`config={"configurable":
{"thread_id": ...}}`) or, without one, the chat model's own id (one workflow per model object).
The endpoint then treats the calls of one run as one workflow: the document its nodes all start
with is computed once and shared (`aaflow.serving.workflows`).

Needs the `langgraph` extra (`pip install 'aaflow[langgraph]'`: langchain-openai, langgraph).
"""

from __future__ import annotations

import uuid
from typing import Any

from langchain_openai import ChatOpenAI
from pydantic import Field


class AAFlowChat(ChatOpenAI):
    """`ChatOpenAI` for an aaflow endpoint, filling in `agent_hints` from LangGraph's metadata."""

    workflow_id: str = Field(default_factory=lambda: uuid.uuid4().hex[:12])
    """The workflow a call belongs to when its graph run names no thread."""
    ttl_s: float | None = None
    """Keep a workflow's shared document this long after each call (the `ttl_s` hint)."""

    def __init__(self, **kwargs: Any) -> None:
        kwargs.setdefault("api_key", "none")  # an aaflow endpoint asks for no key
        super().__init__(**kwargs)

    def hints(self, metadata: dict) -> dict:
        """`agent_hints` for a call made with this LangChain run metadata ({} outside a graph)."""
        node = metadata.get("langgraph_node")
        if node is None:
            return {}
        path = metadata.get("langgraph_path") or ()
        agent = f"{node}[{path[1]}]" if len(path) > 1 and path[0] == "__pregel_push" else node
        hints = {"workflow_id": str(metadata.get("thread_id") or self.workflow_id), "agent_id": agent}
        if self.ttl_s is not None:
            hints["ttl_s"] = self.ttl_s
        return hints

    def _with_hints(self, run_manager, kwargs: dict) -> dict:
        hints = self.hints(getattr(run_manager, "metadata", None) or {})
        if hints:
            extra = {**(self.extra_body or {}), **(kwargs.get("extra_body") or {})}
            kwargs = {**kwargs, "extra_body": {**extra, "agent_hints": {**hints, **extra.get("agent_hints", {})}}}
        return kwargs

    def _generate(self, messages, stop=None, run_manager=None, **kwargs):
        return super()._generate(messages, stop, run_manager, **self._with_hints(run_manager, kwargs))

    async def _agenerate(self, messages, stop=None, run_manager=None, **kwargs):
        return await super()._agenerate(messages, stop, run_manager, **self._with_hints(run_manager, kwargs))

    def _stream(self, messages, stop=None, run_manager=None, **kwargs):
        return super()._stream(messages, stop, run_manager, **self._with_hints(run_manager, kwargs))

    async def _astream(self, messages, stop=None, run_manager=None, **kwargs):
        async for chunk in super()._astream(messages, stop, run_manager, **self._with_hints(run_manager, kwargs)):
            yield chunk
