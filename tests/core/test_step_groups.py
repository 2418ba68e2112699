"""Groups of decode steps in one replica call: the same tokens and KV as single steps, stops at
a budget or an end-of-sequence token, nothing computed is lost to a failing step, and the
scheduler sends groups only where nothing waits for the replica."""

from __future__ import annotations

import pytest
import torch

from aaflow.engine.sampling import SamplingParams
from aaflow.runtime.agent_state import AgentState
from aaflow.runtime.results import AgentResult
from aaflow.runtime.step_groups import GROUP_STEPS, GROUP_TOKENS, steps_per_call, stops
from aaflow.cluster.step_group_runner import StepStop, run_steps
from aaflow.cluster.replica import ModelReplica

GREEDY = SamplingParams(max_new_tokens=64, temperature=0.0)


class Counter:
    """A decode step that gives each session the next number of its own sequence."""

    def __init__(self, fail_at: int | None = None) -> None:
        self.calls, self.fail_at = 0, fail_at

    def __call__(self, sids: list[str]) -> list[int]:
        self.calls += 1
        if self.calls == self.fail_at:
            raise RuntimeError("step failed")
        return [100 * i + self.calls for i in range(len(sids))]


def test_run_steps_stops_at_the_first_budget_or_end_of_sequence():
    out = run_steps(Counter(), ["a", "b"], 8, [StepStop(8), StepStop(3)])
    tokens, ends = out.tokens, out.ends_s
    assert tokens == [[1, 2, 3], [101, 102, 103]] and len(ends) == 3  # b's budget ends the group
    assert ends == sorted(ends)
    out = run_steps(Counter(), ["a", "b"], 8, [StepStop(8, frozenset({2})), StepStop(8)])
    tokens, ends = out.tokens, out.ends_s
    assert tokens == [[1, 2], [101, 102]]  # a decoded its end-of-sequence id at the second step
    out = run_steps(Counter(), ["a"], 5, [StepStop(50)])
    tokens, _ = out.tokens, out.ends_s
    assert tokens == [[1, 2, 3, 4, 5]]


def test_a_failing_step_fails_the_call_with_the_tokens_before_it():
    with pytest.raises(RuntimeError, match="step failed") as failed:
        run_steps(Counter(fail_at=3), ["a"], 8, [StepStop(8)])
    out = failed.value.partial_steps
    tokens, ends = out.tokens, out.ends_s
    assert tokens == [[1, 2]] and len(ends) == 2
    with pytest.raises(RuntimeError, match="step failed") as failed:
        run_steps(Counter(fail_at=1), ["a"], 8, [StepStop(8)])
    assert not hasattr(failed.value, "partial_steps")
    with pytest.raises(ValueError, match="steps must be >= 1"):
        run_steps(Counter(), ["a"], 0, [StepStop(8)])
    with pytest.raises(ValueError, match="one StepStop per session"):
        run_steps(Counter(), ["a", "b"], 2, [StepStop(8)])


def test_a_group_of_steps_equals_single_steps_on_a_replica(tiny_llama_dir):
    single, grouped = (ModelReplica(n, str(tiny_llama_dir), dtype="float32", num_blocks=64) for n in "ab")
    for r in (single, grouped):
        for i, sid in enumerate(("s0", "s1")):
            r.session_open(sid)
            r.session_prefill(sid, list(range(10 + i, 40 + 5 * i)), GREEDY)
    expected = [[], []]
    for _ in range(6):
        for row, token in zip(expected, single.session_step(["s0", "s1"])):
            row.append(token)
    out = grouped.session_steps(["s0", "s1"], 6, [(6, frozenset()), (9, frozenset())])
    tokens, ends = out.tokens, out.ends_s
    assert tokens == expected and len(ends) == 6
    for sid in ("s0", "s1"):
        a, b = (r.engine.export_kv(r.sessions.table[sid].seq_id).kv for r in (single, grouped))
        assert torch.equal(a, b), sid
    eos = expected[1][0]  # s1's first stepped token as its end-of-sequence: the group ends there
    for r in (single, grouped):
        r.session_close("s0"), r.session_close("s1")
        r.session_open("t")
        r.session_prefill("t", list(range(11, 45)), GREEDY)
    out = grouped.session_steps(["t"], 6, [(6, frozenset({eos}))])
    tokens, _ = out.tokens, out.ends_s
    assert tokens == [expected[1][:1]]
    for r in (single, grouped):
        r.session_close("t")
        assert r.engine.stats().used == 0


def _agent(name: str, decoded: int = 0, max_tokens: int = 32, ignore_eos: bool = False) -> AgentState:
    agent = AgentState(name, "m", "text", [], [], max_tokens, ignore_eos=ignore_eos, result=AgentResult(name))
    agent.result.decoded, agent.state = decoded, "decoding"
    return agent


def test_groups_shrink_with_the_batch_and_stop_at_the_first_budget():
    readers = {f"a{i}": [] for i in range(GROUP_TOKENS)}
    assert GROUP_STEPS < GROUP_TOKENS // 2
    assert steps_per_call([_agent("a0")], readers) == GROUP_STEPS
    assert steps_per_call([_agent("a0"), _agent("a1")], readers) == GROUP_STEPS
    assert steps_per_call([_agent(f"a{i}") for i in range(8)], readers) == GROUP_TOKENS // 8
    assert steps_per_call([_agent(f"a{i}") for i in range(GROUP_TOKENS // 2)], readers) == 2
    assert steps_per_call([_agent(f"a{i}") for i in range(GROUP_TOKENS)], readers) == 1
    assert steps_per_call([_agent("a0", decoded=29), _agent("a1")], readers) == 3  # a0 has 3 tokens left
    assert stops([_agent("a0", decoded=29), _agent("a1", ignore_eos=True)], {"m": {2}}) == \
        [(3, frozenset({2})), (32, frozenset())]


def test_a_group_serves_a_batch_whatever_its_end_of_sequence_settings():
    """Agents that may stop at end-of-sequence step in the same groups as those that ignore it (the
    replica stops a session at its end-of-sequence token inside the group), and a large batch steps
    once per call whatever its settings: a run another client submits must not wait for a group."""
    for ignore in (True, False):
        small = [_agent(f"a{i}", ignore_eos=ignore) for i in range(4)]
        large = [_agent(f"b{i}", ignore_eos=ignore) for i in range(64)]
        readers = {a.name: [] for a in small + large}
        assert steps_per_call(small, readers) == GROUP_TOKENS // 4
        assert steps_per_call(large, readers) == 1
    mixed = [_agent("a0", ignore_eos=True), _agent("a1")]
    assert steps_per_call(mixed, {"a0": [], "a1": []}) == GROUP_STEPS
    assert stops(mixed, {"m": {2}}) == [(32, frozenset()), (32, frozenset({2}))]


def test_an_agent_feeding_a_streaming_reader_steps_one_token_per_call():
    reader = _agent("b")
    reader.state = "open"
    assert steps_per_call([_agent("a0")], {"a0": [reader]}) == 1
    reader.state = "done"
    assert steps_per_call([_agent("a0")], {"a0": [reader]}) == GROUP_STEPS
