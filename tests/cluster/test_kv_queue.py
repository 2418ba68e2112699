"""Fair admission across runs on one replica's pool (aaflow/cluster/kv_queue.py), on a real engine."""

from __future__ import annotations

import pytest

from aaflow.common.errors import KVCapacityError
from aaflow.cluster import kv_queue
from aaflow.cluster.kv_queue import KVQueue


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def engine(make_engine, tiny_llama_dir):
    return make_engine(tiny_llama_dir, num_blocks=20)  # 20 blocks of 16 tokens


def test_a_refused_run_keeps_its_blocks_from_later_runs_until_served(engine):
    clock = Clock()
    queue = KVQueue(engine, clock)
    queue.admit(["r2/b#0"], 200)  # nobody waits: anything goes
    queue.refused(["r1/a#0"], KVCapacityError(12, 5))  # r1 needed 12 blocks and was refused
    with pytest.raises(KVCapacityError, match="run r1"):
        queue.admit(["r2/b#0"], 200)  # 13 blocks would leave 7 of 20: r1 waits for 12
    queue.admit(["r2/b#0"], 64)  # 5 blocks leave 15: r1 keeps its 12
    queue.admit(["r1/c#0"], 300)  # the head's own calls are never held back
    queue.admit([], 0)  # a decode-only call
    queue.served(["r1/a#1"])
    queue.admit(["r2/b#0"], 200)
    assert not queue.waiting


def test_runs_queue_in_the_order_they_were_first_refused_and_a_silent_head_is_dropped(engine):
    clock = Clock()
    queue = KVQueue(engine, clock)
    queue.refused(["r1/a#0"], KVCapacityError(18, 2))
    queue.refused(["r2/a#0"], KVCapacityError(18, 2))
    queue.refused(["r1/a#1"], KVCapacityError(18, 2))  # a retry keeps r1's place
    assert list(queue.waiting) == ["r1", "r2"]
    with pytest.raises(KVCapacityError):
        queue.admit(["r2/a#0"], 64)
    clock.now = 5.0
    queue.refused(["r2/a#1"], KVCapacityError(18, 2))  # r2 asks again; r1 stops asking (its run ended)
    clock.now = kv_queue.STALE_HEAD_S + 1
    with pytest.raises(KVCapacityError, match="run r2"):
        queue.admit(["r3/a#0"], 64)
    assert list(queue.waiting) == ["r2"]
    clock.now = 2 * kv_queue.STALE_HEAD_S
    queue.admit(["r3/a#0"], 64)
    assert not queue.waiting
