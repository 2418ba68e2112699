"""Real transport faults between two replica processes, per transport: a source killed while the
destination fetches, a peer that never answers, a stale or forged lease, a truncated or oversized
descriptor. Each ends in a typed error within a bounded wait, with the destination pool untouched;
a received descriptor never makes the receiver allocate beyond the ref's declared size.

Faults are real: processes are frozen (SIGSTOP) and killed (SIGKILL) by pid, handles are
forged field by field as a buggy or hostile peer would send them.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import time
import uuid

import pytest

import aaflow as af
from tests.cluster.transport_params import transport_params

CONTEXT = list(range(30, 30 + 200))  # 200 tokens: several blocks
TIMEOUT_S = 3.0  # the fetch deadline each fault test gives the destination
MARGIN_S = 25.0  # Ray call overhead on a loaded 2-core machine; a hang would exceed it by far


@pytest.fixture(scope="module")
def ray_session():
    import ray

    from aaflow.cluster.actors import start_ray

    start_ray(num_cpus=2)
    yield ray
    ray.shutdown()


def _replica(ray, tiny_llama_dir, role: str):
    from aaflow.cluster.actors import replica_actor

    actor = replica_actor(f"{role}-{uuid.uuid4().hex[:6]}", str(tiny_llama_dir), num_cpus=0, dtype="float32",
                          threads=1, num_blocks=64)
    ray.get(actor.info.remote())
    return actor


@pytest.fixture(scope="module")
def peers(ray_session, tiny_llama_dir):
    """(ray, source, destination): two replica processes the non-lethal faults share."""
    ray = ray_session
    src, dst = _replica(ray, tiny_llama_dir, "src"), _replica(ray, tiny_llama_dir, "dst")
    yield ray, src, dst
    for actor in (src, dst):
        ray.kill(actor)


@pytest.fixture
def pair(peers, tiny_llama_dir):
    """(ray, a fresh source this test may kill, the shared destination)."""
    ray, _, dst = peers
    src = _replica(ray, tiny_llama_dir, "victim")
    yield ray, src, dst
    ray.kill(src)


def _pid(ray, actor) -> int:
    return ray.get(actor.info.remote())["pid"]


def _untouched(ray, dst) -> None:
    stats = ray.get(dst.stats.remote())
    assert (stats["used_blocks"], stats["refs"]) == (0, 0), f"the destination pool was touched: {stats}"


def _receive_fails_in_time(ray, dst, handle, shape, record, transport, error=af.KVTransferError) -> str:
    start = time.monotonic()
    with pytest.raises(error) as info:
        ray.get(dst.receive.remote(handle, shape, record, transport, TIMEOUT_S), timeout=TIMEOUT_S + MARGIN_S)
    assert time.monotonic() - start < TIMEOUT_S + MARGIN_S
    return str(info.value)


@pytest.mark.parametrize("transport", transport_params())
def test_a_source_killed_during_the_fetch_is_a_bounded_typed_error(pair, transport):
    """A typed error within the deadline, or (ray only) an exact copy read from the object store."""
    ray, src, dst = pair
    record = ray.get(src.materialize.remote(CONTEXT))
    exposure = ray.get(src.expose.remote(record.id, transport))
    handle, shape, record = exposure.handle, exposure.shape, exposure.record
    sent = ray.get(src.export_tensor.remote(record.id))  # the bytes the source exposed
    pid = _pid(ray, src)
    os.kill(pid, signal.SIGSTOP)  # the source stalls: the fetch below is in flight when it dies
    try:
        pending = dst.receive.remote(handle, shape, record, transport, TIMEOUT_S)
        time.sleep(1.0)
    finally:
        os.kill(pid, signal.SIGKILL)
    start = time.monotonic()
    try:
        received = ray.get(pending, timeout=TIMEOUT_S + MARGIN_S).record
    except af.KVTransferError:
        received = None
    assert time.monotonic() - start < TIMEOUT_S + MARGIN_S
    again = ray.get(dst.materialize.remote(CONTEXT))  # the destination still works: recompute
    if received is not None:  # the object store holds an exposure's bytes after its owner died
        assert transport == "ray", f"{transport} read from a dead source without its lease"
        assert torch_equal(ray.get(dst.export_tensor.remote(received.id)), sent)
        ray.get(dst.free.remote(received.id))
    ray.get(dst.free.remote(again.id))
    _untouched(ray, dst)


@pytest.mark.parametrize("transport", [p for p in transport_params() if p.id != "ray"])
def test_a_peer_that_never_answers_times_out_and_the_source_recovers(peers, transport):
    """nixl and ucx ask the source for a lease before reading: a frozen source never grants it.
    (`ray` reads the object store, which a frozen owner does not serve either; see the kill test.)"""
    ray, src, dst = peers
    record = ray.get(src.materialize.remote(CONTEXT))
    exposure = ray.get(src.expose.remote(record.id, transport))
    handle, shape, record = exposure.handle, exposure.shape, exposure.record
    pid = _pid(ray, src)
    os.kill(pid, signal.SIGSTOP)
    try:
        message = _receive_fails_in_time(ray, dst, handle, shape, record, transport)
    finally:
        os.kill(pid, signal.SIGCONT)
    assert "timed out" in message or "no answer" in message, message
    _untouched(ray, dst)
    received = ray.get(dst.receive.remote(handle, shape, record, transport, 30.0)).record  # the source is back
    ray.get([src.release.remote(handle, transport), src.free.remote(record.id), dst.free.remote(received.id)])
    _untouched(ray, dst)
    assert ray.get(src.stats.remote())["used_blocks"] == 0


@pytest.mark.parametrize("transport", transport_params())
def test_stale_and_forged_leases_are_refused_quickly(peers, transport):
    ray, src, dst = peers
    record = ray.get(src.materialize.remote(CONTEXT))
    exposure = ray.get(src.expose.remote(record.id, transport))
    handle, shape, record = exposure.handle, exposure.shape, exposure.record
    forged = dataclasses.replace(handle, handle_id=uuid.uuid4().hex)  # an exposure the source never made
    _receive_fails_in_time(ray, dst, forged, shape, record, transport)
    ray.get(src.release.remote(handle, transport))
    _receive_fails_in_time(ray, dst, handle, shape, record, transport)  # stale: released at the source
    _untouched(ray, dst)
    ray.get(src.free.remote(record.id))
    assert ray.get(src.stats.remote())["used_blocks"] == 0


@pytest.mark.parametrize("transport", transport_params())
def test_truncated_and_oversized_descriptors_allocate_nothing(peers, transport):
    ray, src, dst = peers
    record = ray.get(src.materialize.remote(CONTEXT))
    exposure = ray.get(src.expose.remote(record.id, transport))
    handle, shape, record = exposure.handle, exposure.shape, exposure.record
    per_token = record.nbytes // len(record.token_ids)
    huge = 10**7  # tokens: gigabytes if a receiver sized its buffers from the descriptor
    forgeries = {
        "handle shorter than the ref": (dataclasses.replace(handle, nbytes=handle.nbytes - per_token), shape, record),
        "handle longer than the ref": (dataclasses.replace(handle, nbytes=handle.nbytes * 1000), shape, record),
        "ref declares fewer bytes": (handle, shape, dataclasses.replace(record, nbytes=per_token)),
        "truncated token ids": (handle, shape, dataclasses.replace(record, token_ids=record.token_ids[:-1])),
        "shape of a huge ref": (dataclasses.replace(handle, nbytes=huge * per_token),
                                dataclasses.replace(shape, shape=(shape.shape[0], 2, huge, *shape.shape[3:])),
                                dataclasses.replace(record, token_ids=(1,) * huge, nbytes=huge * per_token)),
        "dims dropped": (handle, dataclasses.replace(shape, shape=shape.shape[:3]), record),
        "not a record": (handle, shape, {"id": record.id, "token_ids": record.token_ids}),
    }
    for what, (h, s, r) in forgeries.items():
        message = _receive_fails_in_time(ray, dst, h, s, r, transport, error=af.KVImportError)
        assert "forged" in message or "does not match" in message or "malformed" in message, (what, message)
        _untouched(ray, dst)
    received = ray.get(dst.receive.remote(handle, shape, record, transport, 30.0)).record  # the true one still works
    assert torch_equal(ray.get(src.export_tensor.remote(record.id)), ray.get(dst.export_tensor.remote(received.id)))
    ray.get([src.release.remote(handle, transport), src.free.remote(record.id), dst.free.remote(received.id)])
    _untouched(ray, dst)


def torch_equal(a, b) -> bool:
    import torch

    return torch.equal(a, b)


@pytest.fixture(scope="module")
def cluster(ray_session, tiny_llama_dir):
    """A 2-replica cluster in this module's Ray (after the raw replica pairs)."""
    from aaflow.cluster.calibration import ensure_profile

    c = af.init(replicas={str(tiny_llama_dir): 2}, num_cpus=2, dtype="float32", kv_cache_bytes=8 * 2**20)
    ensure_profile(c)
    yield c, str(tiny_llama_dir)
    c.shutdown()


@pytest.mark.parametrize("transport", transport_params())
def test_a_workflow_meeting_stale_leases_falls_back_to_recompute(cluster, transport):
    """Every exposure is released before the peer reads it: each transfer fails inside the real
    transport, and the run recomputes instead, with the text baseline's tokens and no KV left."""
    from tests.cluster_checks import assert_no_kv_left
    from tests.frontend.test_workflow_run import fan_out

    c, model = cluster
    wf = fan_out(model)
    expected = {n: a.token_ids for n, a in af.run(wf, c, strategy="text").agents.items()}
    for r in c.replicas():
        ray_get(r.actor.inject_fault.remote("stale", 50))
    try:
        res = af.run(wf, c, strategy="transfer", transport=transport, call_timeout_s=60)
    finally:
        for r in c.replicas():
            ray_get(r.actor.clear_fault.remote())
    assert {n: a.token_ids for n, a in res.agents.items()} == expected
    assert any("recomputing instead" in e for e in res.events), res.events
    assert res.metrics["bytes_moved"] == 0
    assert_no_kv_left(c)


def ray_get(ref):
    import ray

    return ray.get(ref)


def test_the_leak_check_reports_and_clears_kv_left_on_a_replica(peers):
    from tests.leak_checks import LeakWatch

    ray, src, dst = peers
    watch = LeakWatch()
    ray.get(dst.materialize.remote(CONTEXT))  # never freed
    (problem,) = watch.problems()
    assert "refs" in problem and "1 refs" in problem, problem
    _untouched(ray, dst)  # the check closed the replica's refs
