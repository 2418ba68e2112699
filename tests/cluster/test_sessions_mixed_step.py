"""A mixed step (decode some sessions, prefill others, one forward pass) answers as a decode step
followed by a packed prefill would."""

from __future__ import annotations

import torch

from aaflow.engine.sampling import SamplingParams
from aaflow.cluster.replica import ModelReplica

GREEDY = SamplingParams(max_new_tokens=8, temperature=0.0)


def _start(replica: ModelReplica) -> None:
    for i, sid in enumerate(("d0", "d1")):  # decoding sessions of different lengths
        replica.session_open(sid)
        replica.session_prefill(sid, list(range(10 + i, 30 + 7 * i)), GREEDY)
    replica.session_open("p0")
    replica.session_prefill("p0", list(range(50, 70)))  # a streamed prompt, partly prefilled
    replica.session_open("p1")  # a prompt not started yet


def _kv(replica: ModelReplica, sid: str) -> torch.Tensor:
    return replica.engine.export_kv(replica.sessions.table[sid].seq_id).kv


def test_mixed_step_equals_a_step_then_a_packed_prefill(tiny_llama_dir):
    requests = [("p0", list(range(70, 86)), None, True), ("p1", list(range(90, 99)), GREEDY, True)]
    apart, mixed = (ModelReplica(n, str(tiny_llama_dir), dtype="float32", num_blocks=64) for n in "ab")
    for r in (apart, mixed):
        _start(r)
    tokens = apart.session_step(["d0", "d1"])
    outs = apart.session_prefill_many(requests)
    reply = mixed.session_step_mixed(["d0", "d1"], requests)
    mixed_tokens, mixed_outs = reply.tokens, reply.prefills
    assert mixed_tokens == tokens
    assert [o.token for o in mixed_outs] == [o.token for o in outs]
    assert [o.computed for o in mixed_outs] == [o.computed for o in outs] == [16, 9]
    for sid in ("d0", "d1", "p0", "p1"):
        assert torch.allclose(_kv(mixed, sid), _kv(apart, sid), atol=1e-5, rtol=1e-5), sid
    assert mixed.session_step(["d0", "d1", "p1"]) == apart.session_step(["d0", "d1", "p1"])
    for r in (apart, mixed):
        for sid in ("d0", "d1", "p0", "p1"):
            r.session_close(sid)
        assert r.engine.stats().used == 0
