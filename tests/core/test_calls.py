"""The replica calls (aaflow/runtime/calls.py, operator_calls.py, probe_calls.py): one class per kind,
whose positional fields are the replica method's arguments in its order, and which names its reply."""

from __future__ import annotations

import inspect

import pytest

from aaflow.cluster.replica import ModelReplica
from aaflow.cluster.replica_base import ReplicaBase
from aaflow.cluster.vllm_replica import VLLMReplica
from aaflow.runtime import calls, operator_calls, probe_calls
from aaflow.runtime.calls import Call, CallKind, MixedCall, PrefillRequest, ReceiveCall
from aaflow.runtime.operator_calls import GenerateCall


def _call_classes() -> list[type[Call]]:
    return [c for module in (calls, operator_calls, probe_calls) for c in vars(module).values()
            if isinstance(c, type) and issubclass(c, Call) and "kind" in vars(c)]


def test_each_kind_has_one_call_class_whose_fields_are_its_replica_methods_parameters():
    classes = _call_classes()
    assert sorted(c.kind.name for c in classes) == sorted(k.name for k in CallKind)
    renamed = {"text_or_ids": "token_ids"}  # the scheduler materializes token ids (af.materialize: text too)
    for cls in classes:
        assert "Reply" in vars(cls), f"{cls.__name__} names no reply"
        for replica in (ReplicaBase, ModelReplica, VLLMReplica):  # the interface and both engines
            params = list(inspect.signature(getattr(replica, cls.kind.value)).parameters.values())[1:]
            params = [p for p in params if p.kind is not p.VAR_KEYWORD]
            fields = cls.__match_args__
            names = [renamed.get(p.name, p.name) if cls is not GenerateCall else p.name for p in params[:len(fields)]]
            assert names == list(fields), (replica.__name__, cls.__name__, params)
            assert all(p.default is not p.empty for p in params[len(fields):]), (replica.__name__, cls.__name__, params)


def test_a_replica_runs_a_typed_call_and_nothing_else(tiny_llama_dir):
    replica = ModelReplica("r", str(tiny_llama_dir), dtype="float32", num_blocks=32)
    try:
        record = replica.run(calls.MaterializeCall([5, 6, 7, 8]))
        assert replica.run(probe_calls.StatsCall())["refs"] == 1
        forks = replica.run(operator_calls.ForkCall(record.id, 2))
        out = replica.run(GenerateCall(record.id, [9, 10], 3, sampling={"temperature": 0.0}))
        assert len(out.token_ids) == 3 and len(forks) == 2
        with pytest.raises(TypeError, match="runs a Call"):
            replica.run("materialize")  # a method name is not a call
    finally:
        replica.close()


def test_arguments_are_the_positional_fields_without_threads():
    request = PrefillRequest("b", [4, 5])
    mixed = MixedCall(["a"], [request], threads=3)
    assert mixed.arguments() == (["a"], [request]) and mixed.method == "session_step_mixed"
    assert mixed.sessions == ["a", "b"] and mixed.tokens == 2
    assert mixed.with_threads(0) == MixedCall(["a"], [request])
    assert ReceiveCall("h", "shape", "rec", "ray").arguments() == ("h", "shape", "rec", "ray")
