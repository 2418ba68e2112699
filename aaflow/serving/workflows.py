"""Requests as workflows: one agent per request, and what workflow hints add.

A request's prompt is its chat rendered by the model's chat template and tokenized whole, as vLLM
tokenizes it (`PromptBuilder.chat`): the same request gives the same prompt token ids, and the
same `usage.prompt_tokens`, on both. The agent gets those ids as token-id contexts of a `rendered`
prompt (no chat frame applied again, nothing joined in between): its static prefix, then the rest.

Without hints the static prefix is the chat header (up to the user turn's start) and the request
is a one-agent workflow under `text`: the replicas' prefix cache shares identical token prefixes
between requests, and the deployment's one loop batches them, as on a serving engine.

With `agent_hints.workflow_id`, the endpoint remembers the prompt ids of the workflow's first
request (its reference). A later request of the workflow shares the longest token prefix it has in
common with the reference, short of its own last token, if that reaches `MIN_SHARED_TOKENS`
beyond the chat header: that prefix is its static prefix, which the scheduler materializes once and
forks for every agent that reads it, moves to another replica that needs it, keeps while agents
that read it are pending and, with `ttl_s`, that long after (`keep_prefix_s`; a prefix other
workflows shared before, `KEEP_KNOWN_S` after, while no agent waits for the KV room it takes). The
reference is then cut to the prefix shared, so that the workflow's later requests share that same prefix (one KV
object for them all) or a shorter one. A prefix so shared is remembered across workflows
(`aaflow.serving.known_prefixes`): any other request whose prompt begins with it (another
workflow's first request, a request without hints) shares it too. Such requests run under
`transfer` (the planner, seeing a one-agent workflow, would not share a prefix with requests it
cannot see); the others under `text`.

`reads` (the agents whose answers the prompt holds) is accepted and not used yet: by the time a
client sends a reader's request it has the answer as text, so there is nothing left to stream into
the reader's prefill; an upstream answer named there would first have to be sent unfinished.
"""

from __future__ import annotations

import threading
import time
from array import array
from dataclasses import dataclass

import aaflow as af
from aaflow.runtime.prompts import PromptBuilder
from aaflow.serving.known_prefixes import KEEP_KNOWN_S, MIN_SHARED_TOKENS, KnownPrefixes
from aaflow.serving.requests import AgentHintsBody, RequestError

FORGET_AFTER_S = 600.0  # a hinted workflow not heard from for this long is forgotten
WORKFLOWS_KEPT = 4096


@dataclass
class _Hinted:
    reference: array  # the first request's prompt ids, cut to the prefix shared since
    seen_s: float = 0.0


class HintedWorkflows:
    """What the endpoint remembers of each hinted workflow, and the prefixes they shared (`known`;
    thread-safe)."""

    def __init__(self) -> None:
        self._workflows: dict[str, _Hinted] = {}
        self._lock = threading.Lock()
        self.known = KnownPrefixes()

    def shared_prefix(self, workflow_id: str, ids: tuple[int, ...], header: int) -> int:
        """How many leading `ids` (a request's prompt, `header` of them its chat header) the request
        shares with its workflow (see the module docstring); 0 for none. A first request is remembered."""
        now = time.monotonic()
        with self._lock:
            self._forget_idle(now)
            known = self._workflows.get(workflow_id)
            if known is None:
                self._workflows[workflow_id] = _Hinted(array("i", ids), seen_s=now)
                return 0
            known.seen_s = now
            reference = known.reference
            limit = min(len(reference), len(ids) - 1)  # something of its own follows the shared prefix
            common = next((i for i in range(limit) if reference[i] != ids[i]), limit)
            if common - header < MIN_SHARED_TOKENS:
                return 0
            del reference[common:]
        return common

    def _forget_idle(self, now: float) -> None:
        idle = [w for w, k in self._workflows.items() if now - k.seen_s > FORGET_AFTER_S]
        for w in idle:
            del self._workflows[w]
        while len(self._workflows) > WORKFLOWS_KEPT:
            del self._workflows[next(iter(self._workflows))]


@dataclass(frozen=True)
class ServerPlan:
    """The server's own strategy for a request's agent, given to `af.start` as the plan of an "auto"
    run: the agent counts as planned, so where its replica lacks the shared prefix, the cost model
    says whether it is moved there or computed there (a strategy a user names is followed as named)."""

    decisions: dict[str, str]


@dataclass(frozen=True)
class RequestRun:
    """A request as a run: its workflow, the agent that answers, the strategy and run options."""

    workflow: object
    agent: str
    strategy: str
    options: dict
    max_tokens: int


def request_run(builder: PromptBuilder, model: str, system: str | None, history: list[tuple[str, str]], user: str,
                sampling: dict, hints: AgentHintsBody | None, remembered: HintedWorkflows,
                request_id: str) -> RequestRun:
    """The workflow that answers one request (see the module docstring); `builder` is the
    `PromptBuilder` of the model's tokenizer."""
    ids, header = builder.chat(system, tuple(history), user)
    if len(ids) < 2:
        raise RequestError(f"the chat template renders this request as {len(ids)} token(s); nothing to answer",
                           "messages")
    agent, strategy, options, shared = "answer", "text", {}, 0
    if hints is not None and hints.workflow_id:
        agent = hints.agent_id or agent
        shared = remembered.shared_prefix(hints.workflow_id, ids, header)
        if shared:
            remembered.known.remember(model, ids[:shared], header)
        if hints.ttl_s:
            options["keep_prefix_s"] = hints.ttl_s
    if not shared:
        shared = remembered.known.longest(model, ids, header)
        if shared:  # read by other workflows before: the next reader may well come soon
            options.setdefault("keep_prefix_s", KEEP_KNOWN_S)
    if shared:
        strategy, options["plan"] = "auto", ServerPlan({agent: "transfer"})
    lead = shared or min(max(header, 1), len(ids) - 1)
    wf = af.Workflow(f"request-{request_id}")
    try:
        prefix = wf.context(f"{agent}:{'shared' if shared else 'header'}", token_ids=ids[:lead])
        wf.agent(agent, model, [prefix, wf.context(f"{agent}:turn", token_ids=ids[lead:])], rendered=True, **sampling)
    except af.WorkflowError as exc:
        raise RequestError(str(exc), "messages") from exc
    return RequestRun(wf, agent, strategy, options, sampling["max_tokens"])
