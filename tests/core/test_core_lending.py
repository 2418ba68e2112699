"""Idle cores lent to a long prefill: which calls borrow, from whom, and that a loan ends with the call."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from aaflow.runtime.calls import MaterializeCall, OpenCall, PackCall, PrefillCall, PrefillRequest
from aaflow.runtime.core_lending import lent_threads
from aaflow.cluster.replica import ModelReplica


def _replicas(*specs):
    return [SimpleNamespace(name=name, engine=engine) for name, engine in specs]


def test_call_tokens_counts_what_each_prefill_call_computes():
    assert MaterializeCall([1] * 300).tokens == 300
    assert PrefillCall("sid", [1] * 40, None, True).tokens == 40
    pack = [PrefillRequest("a", [1] * 30, None, True), PrefillRequest("b", [1] * 50, None, False)]
    assert PackCall(pack).tokens == 80
    assert OpenCall("sid").tokens == 0


def test_only_idle_builtin_replicas_of_the_same_node_lend_their_threads():
    a, b, c, v = replicas = _replicas(("a", "builtin"), ("b", "builtin"), ("c", "builtin"), ("v", "vllm"))
    info = {"a": {"node": "n1", "threads": 1}, "b": {"node": "n1", "threads": 2},
            "c": {"node": "n2", "threads": 4}, "v": {"node": "n1", "threads": 8}}
    assert lent_threads(a, replicas, info, idle={"b", "c", "v"}) == 2  # c is on another node, v is vLLM
    assert lent_threads(a, replicas, info, idle=set()) == 0
    assert lent_threads(a, replicas, info, idle={"a"}) == 0  # never from itself
    assert lent_threads(v, replicas, info, idle={"a", "b"}) == 0  # a vLLM replica keeps its own threads
    assert lent_threads(a, replicas, {**info, "a": {"threads": 1}}, idle={"b"}) == 0  # node unknown


def test_a_prefill_runs_on_lent_threads_and_gives_them_back(tiny_llama_dir):
    replica = ModelReplica("r", str(tiny_llama_dir), dtype="float32", threads=1, num_blocks=64)
    seen = []
    materialize = replica.materialize
    replica.materialize = lambda ids: (seen.append(torch.get_num_threads()), materialize(ids))[1]
    try:
        record = replica.with_threads(2, "materialize", list(range(3, 40)))
        assert seen == [2] and torch.get_num_threads() == 1
        assert record.token_ids == tuple(range(3, 40))
        with pytest.raises(ValueError, match="only prefill calls"):
            replica.with_threads(2, "free", record.id)
        with pytest.raises(ValueError, match="threads must be"):
            replica.with_threads(0, "materialize", [5, 6])
        assert torch.get_num_threads() == 1
    finally:
        replica.close()
