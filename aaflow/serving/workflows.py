"""Requests as workflows: one agent per request, and what workflow hints add.

Without hints a request is a one-agent workflow under `text`: the replicas' prefix cache and the
deployment's one loop (continuous batching) serve it, as on a serving engine. Its user message is
split at blank lines into prompt parts, as the DSL joins them: the same text comes out as the same
tokens an `af.run` of the workflow it stands for prefills (a blank line is one token there).

With `agent_hints.workflow_id`, the endpoint remembers the workflow's first request. A later
request of the same workflow whose user message starts with the same paragraphs (a document its
agents all read) gets those paragraphs as a context of its own: the agent's static prefix is then
the chat header and that document, which the scheduler materializes once and forks for every
agent that reads it, moves to another replica that needs it, keeps while
agents that read it are pending and, with `ttl_s`, that long after (`keep_prefix_s`). Such
requests run under `transfer` (the planner, seeing a one-agent workflow, would not share a prefix
with requests it cannot see); the others under `text`.

`reads` (the agents whose answers the prompt holds) is accepted and not used yet: by the time a
client sends a reader's request it has the answer as text, so there is nothing left to stream into
the reader's prefill; an upstream answer named there would first have to be sent unfinished.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

import aaflow as af
from aaflow.serving.requests import AgentHintsBody, RequestError

PARAGRAPH = "\n\n"  # the DSL joins prompt parts with a blank line: a split there renders the same text
FORGET_AFTER_S = 600.0  # a hinted workflow not heard from for this long is forgotten
WORKFLOWS_KEPT = 4096


@dataclass
class _Hinted:
    lead: list[str]  # the first request's user message, in paragraphs
    seen_s: float = 0.0


class HintedWorkflows:
    """What the endpoint remembers of each hinted workflow (thread-safe)."""

    def __init__(self) -> None:
        self._workflows: dict[str, _Hinted] = {}
        self._lock = threading.Lock()

    def shared_lead(self, workflow_id: str, user: str) -> str:
        """The leading paragraphs `user` shares with the workflow's first request ("" when none, or
        when nothing of its own would follow them); a first request is remembered."""
        paragraphs = user.split(PARAGRAPH)
        now = time.monotonic()
        with self._lock:
            self._forget_idle(now)
            known = self._workflows.get(workflow_id)
            if known is None:
                self._workflows[workflow_id] = _Hinted(paragraphs, seen_s=now)
                return ""
            known.seen_s = now
            common = 0
            while common < min(len(paragraphs) - 1, len(known.lead)) and paragraphs[common] == known.lead[common]:
                common += 1
        return PARAGRAPH.join(paragraphs[:common])

    def _forget_idle(self, now: float) -> None:
        idle = [w for w, k in self._workflows.items() if now - k.seen_s > FORGET_AFTER_S]
        for w in idle:
            del self._workflows[w]
        while len(self._workflows) > WORKFLOWS_KEPT:
            del self._workflows[next(iter(self._workflows))]


@dataclass(frozen=True)
class RequestRun:
    """A request as a run: its workflow, the agent that answers, the strategy and run options."""

    workflow: object
    agent: str
    strategy: str
    options: dict
    max_tokens: int


def request_run(model: str, system: str | None, history: list[tuple[str, str]], user: str, sampling: dict,
                hints: AgentHintsBody | None, remembered: HintedWorkflows, request_id: str) -> RequestRun:
    """The workflow that answers one request (see the module docstring)."""
    agent = "answer"
    wf = af.Workflow(f"request-{request_id}")
    paragraphs = user.split(PARAGRAPH)
    parts: list = paragraphs if all(paragraphs) else [user]  # an empty paragraph has no part of its own
    strategy, options = "text", {}
    if hints is not None and hints.workflow_id:
        agent = hints.agent_id or agent
        lead = remembered.shared_lead(hints.workflow_id, user)
        if all(paragraphs) and (lead or len(paragraphs) > 1):
            # a later request: the shared paragraphs; the first: all but its last (its document, as
            # far as it can tell), so that its prefix has the readers' identity and placement sends
            # them where its prefix cache holds it
            shared = len(lead.split(PARAGRAPH)) if lead else len(paragraphs) - 1
            parts = [wf.context(f"lead{i}:{agent}", p) for i, p in enumerate(paragraphs[:shared])] + paragraphs[shared:]
            strategy = "transfer" if lead else "text"
        if hints.ttl_s:
            options["keep_prefix_s"] = hints.ttl_s
    try:
        wf.agent(agent, model, parts, system=system, history=history, **sampling)
    except af.WorkflowError as exc:
        raise RequestError(str(exc), "messages") from exc
    return RequestRun(wf, agent, strategy, options, sampling["max_tokens"])
