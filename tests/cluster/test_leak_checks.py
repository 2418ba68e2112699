"""The per-test leak check itself (`tests/leak_checks.py`): each kind of leak it watches is reported
and cleaned up. (KV left on a Ray replica: `test_transport_faults.py`, which has replicas running.)"""

from __future__ import annotations

import threading

from aaflow.cluster.transports import get_transport
from tests.leak_checks import LeakWatch


def test_an_endpoint_left_open_is_reported_and_closed():
    watch = LeakWatch()
    transport = get_transport("local")
    problems = watch.problems()
    assert problems == ["transport endpoint 'local' created by the test was never closed"]
    assert transport._closed, "the check closes what it reports"
    assert watch.problems() == []


def test_a_thread_left_running_is_reported():
    watch = LeakWatch()
    stop = threading.Event()
    thread = threading.Thread(target=stop.wait, name="forgotten")
    thread.start()
    try:
        assert watch.problems() == ["thread 'forgotten' started by the test is still running"]
    finally:
        stop.set()
        thread.join()
    assert watch.problems() == []


def test_a_closed_endpoint_and_an_ended_thread_are_not_leaks():
    watch = LeakWatch()
    with get_transport("local"):
        pass
    thread = threading.Thread(target=lambda: None)
    thread.start()
    thread.join()
    assert watch.problems() == []
