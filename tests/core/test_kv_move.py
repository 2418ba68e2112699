"""The one expose -> receive -> release protocol (aaflow/runtime/kv_move.py), driven call by call
and through call queues."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from aaflow.runtime.calls import ExposeCall, ReceiveCall, ReleaseCall
from aaflow.runtime.kv_move import move_now, start_move
from aaflow.runtime.replies import Exposure, Received


def test_move_now_releases_the_exposure_even_when_the_receive_fails():
    log = []

    def call(replica, typed_call):
        log.append((replica, typed_call))
        if isinstance(typed_call, ExposeCall):
            return Exposure("h", "shape", "rec")
        if isinstance(typed_call, ReceiveCall) and replica == "bad":
            raise RuntimeError("link down")
        return Received("new-ref", "stats") if isinstance(typed_call, ReceiveCall) else None

    assert move_now(call, "src", "dst", "ref1", "ucx") == Received("new-ref", "stats")
    assert log == [("src", ExposeCall("ref1", "ucx")), ("dst", ReceiveCall("h", "shape", "rec", "ucx")),
                   ("src", ReleaseCall("h", "ucx"))]
    log.clear()
    with pytest.raises(RuntimeError, match="link down"):
        move_now(call, "src", "bad", "ref1", "ucx")
    assert log[-1] == ("src", ReleaseCall("h", "ucx"))


def test_a_queued_move_launches_each_call_after_the_previous_answer():
    queued, clock = [], [0.0]
    queues = SimpleNamespace(call=lambda replica, call, then=None: queued.append((replica, call, then)),
                             now=lambda: clock[0])
    got = []
    move = start_move(queues, "src", "dst", "ref1", "ray", got.append)
    assert [q[:2] for q in queued] == [("src", ExposeCall("ref1", "ray"))] and move.release_call() is None
    queued[0][2].started_s, clock[0] = 1.0, 1.5  # launched after queueing 1 s, answered 0.5 s later
    queued[0][2](Exposure("h", "shape", "rec"))  # exposed
    assert queued[1][:2] == ("dst", ReceiveCall("h", "shape", "rec", "ray"))
    assert move.release_call() == ReleaseCall("h", "ray")  # a failure now must release it
    queued[1][2].started_s, clock[0] = 2.0, 2.25
    queued[1][2](Received("record", "stats"))  # received
    assert queued[2][:2] == ("src", ReleaseCall("h", "ray")) and got == [Received("record", "stats")]
    assert move.release_call() is None  # released already
    assert move.ran_s == pytest.approx(0.75)  # the two calls' own time, not their time queued
