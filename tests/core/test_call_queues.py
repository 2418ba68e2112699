"""The per-replica call queues: bookkeeping calls (opens, closes) never take a decode step's turn,
and a run of them goes in one launch, so prompt segments queued behind a burst of them reach the
replica at the next step; a refused mixed step is followed by a step of its decoding agents alone."""

from __future__ import annotations

from aaflow.runtime.agent_state import AgentState
from aaflow.runtime.backend import Backend, ReplicaInfo, Ticket
from aaflow.runtime.call_queues import CallQueues
from aaflow.runtime.calls import CallKind, CloseCall, OpenCall, PrefillCall
from aaflow.runtime.results import AgentResult
from aaflow.runtime.scheduler_state import SchedulerState


class Launches(Backend):
    """A backend that only writes down the kind of each call it is given."""

    def __init__(self) -> None:
        self.kinds: list[str] = []

    def replicas(self):
        return [ReplicaInfo("r0", "m")]

    def now(self) -> float:
        return 0.0

    def submit(self, replica, call):
        self.kinds.append(call.kind.name)
        return Ticket(len(self.kinds), replica, call)

    def wait(self, tickets, num_returns, timeout_s):
        return tickets[:num_returns]

    def result(self, ticket):
        return None


def _decoding(name: str) -> AgentState:
    agent = AgentState(name, "m", "text", [], [], 32, result=AgentResult(name))
    agent.state, agent.sid = "decoding", name
    return agent


def _queues_with_8_decoding(backend: Launches) -> CallQueues:
    """Queues on one replica that decodes 8 agents (8 or more: one step per call)."""
    agents = [_decoding(f"a{i}") for i in range(8)]
    state = SchedulerState(backend, eos={"m": {0}}, decoding={"r0": agents},
                           streaming_readers={a.name: [] for a in agents})
    return CallQueues(state, lend_cores=False, decoded=lambda agents, tokens, ends: None)


def _run(queues: CallQueues, rounds: int) -> None:
    """Launch, then end the call in flight, `rounds` times (callbacks are not run)."""
    for _ in range(rounds):
        queues.launch()
        for ticket in list(queues.inflight):
            queues.finish(ticket)


def test_opens_and_closes_go_between_two_steps_and_the_prompt_behind_them_mixes_in():
    backend = Launches()
    queues = _queues_with_8_decoding(backend)
    queues.last_kind["r0"] = CallKind.STEP  # the replica has just stepped
    for sid in ("x", "y", "z"):
        queues.call("r0", CloseCall(f"old-{sid}"))
        queues.call("r0", OpenCall(sid))
    queues.call("r0", PrefillCall("w", [1, 2, 3]))
    queues.launch()
    assert backend.kinds == ["CLOSE", "OPEN"] * 3 and len(queues.inflight) == 6  # sent together
    queues.launch()
    assert len(backend.kinds) == 6  # nothing more while any of them is in flight
    for ticket in list(queues.inflight)[:5]:
        queues.finish(ticket)
    queues.launch()
    assert len(backend.kinds) == 6
    _run(queues, 3)
    assert backend.kinds == ["CLOSE", "OPEN"] * 3 + ["MIXED", "STEPS"]  # then, the queue empty, a group


def test_after_a_refused_mixed_step_the_decoding_agents_step_alone_once():
    """A mixed step refused for KV did not step its decoding agents either: the next call is their
    step, so a prompt that keeps being refused (and retried) never starves them."""
    backend = Launches()
    queues = _queues_with_8_decoding(backend)
    queues.step_first.add("r0")  # what the scheduler does after a refused MIXED call (`Recovery.failure`)
    queues.call("r0", PrefillCall("w", [1, 2, 3]))
    _run(queues, 2)
    assert backend.kinds == ["STEP", "MIXED"]
