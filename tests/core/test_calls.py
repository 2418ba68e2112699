"""The replica calls (aaflow/runtime/calls.py): one class per kind, whose positional fields are the
replica method's arguments in its order."""

from __future__ import annotations

import inspect

from aaflow.runtime import calls
from aaflow.runtime.calls import Call, CallKind, MixedCall, PrefillRequest, ReceiveCall
from aaflow.cluster.replica_api import Replica


def _call_classes() -> list[type[Call]]:
    return [c for c in vars(calls).values() if isinstance(c, type) and issubclass(c, Call) and "kind" in vars(c)]


def test_each_kind_has_one_call_class_whose_fields_are_its_replica_methods_parameters():
    classes = _call_classes()
    assert sorted(c.kind.name for c in classes) == sorted(k.name for k in CallKind)
    renamed = {"text_or_ids": "token_ids"}  # the scheduler materializes token ids only
    for cls in classes:
        params = list(inspect.signature(getattr(Replica, cls.kind.value)).parameters.values())[1:]
        fields = cls.__match_args__
        assert [renamed.get(p.name, p.name) for p in params[:len(fields)]] == list(fields), (cls.__name__, params)
        assert all(p.default is not p.empty for p in params[len(fields):]), (cls.__name__, params)


def test_arguments_are_the_positional_fields_without_threads():
    request = PrefillRequest("b", [4, 5])
    mixed = MixedCall(["a"], [request], threads=3)
    assert mixed.arguments() == (["a"], [request]) and mixed.method == "session_step_mixed"
    assert mixed.sessions == ["a", "b"] and mixed.tokens == 2
    assert mixed.with_threads(0) == MixedCall(["a"], [request])
    assert ReceiveCall("h", "shape", "rec", "ray").arguments() == ("h", "shape", "rec", "ray")
