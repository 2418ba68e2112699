"""One suite for every KV transport: exact copies between two processes, and fast failures.

`local` is the reference and runs in this process; `ray`, `nixl` and `ucx` move tensors
between two Ray actors (one local Ray started once for the module). A backend is skipped
only when its package is not installed. The endpoints: transport_peers.py; the registry and
the in-process checks that need no peers: test_transport_registry.py.
"""

from __future__ import annotations

import dataclasses
import os
import pickle
import shutil
import sys
import tempfile

import pytest
import torch

from aaflow.cluster.transports import available_transports
from aaflow.cluster.transports.local import LocalHandle
from tests.cluster.transport_peers import BACKENDS, FAST_S, SMOLLM2_77, SMOLLM2_512, TINY, Peer, RemotePeer

SPECS = [
    (TINY, "bfloat16"),
    (TINY, "float32"),
    (SMOLLM2_77, "bfloat16"),
    (SMOLLM2_77, "float32"),
    (SMOLLM2_512, "bfloat16"),
    (SMOLLM2_512, "float32"),
]
_RAY_SINGLE_MACHINE = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"


@pytest.fixture(scope="module")
def ray_cluster():
    """A local Ray bound to loopback only, started once for this module."""
    ray = pytest.importorskip("ray")
    from ray._private import ray_constants

    from aaflow.cluster.actors import loopback_only

    saved = os.environ.get(_RAY_SINGLE_MACHINE), ray_constants.ENABLE_RAY_CLUSTER
    loopback_only()  # restored below, so later modules see Ray's defaults
    temp_dir = tempfile.mkdtemp(prefix="aaf-ray-", dir="/tmp")  # short: unix socket paths
    ray.init(
        num_cpus=2,
        _node_ip_address="127.0.0.1",
        include_dashboard=False,
        _temp_dir=temp_dir,
        logging_level="ERROR",
        log_to_driver=False,
    )
    ray.cloudpickle.register_pickle_by_value(sys.modules[Peer.__module__])  # actors need Peer (transport_peers.py)
    yield ray
    ray.shutdown()
    ray_constants.ENABLE_RAY_CLUSTER = saved[1]
    if saved[0] is None:
        os.environ.pop(_RAY_SINGLE_MACHINE, None)
    else:
        os.environ[_RAY_SINGLE_MACHINE] = saved[0]
    shutil.rmtree(temp_dir, ignore_errors=True)


@pytest.fixture(scope="module", params=BACKENDS)
def peers(request):
    """(source, destination) for one backend; two processes except for `local`."""
    name = request.param
    reason = available_transports()[name]
    if reason is not True:
        pytest.skip(f"{name}: {reason}")
    if name == "local":
        source, destination = Peer(name), Peer(name)
        yield source, destination
        source.close()
        destination.close()
        return
    ray = request.getfixturevalue("ray_cluster")
    actor = ray.remote(Peer).options(num_cpus=0, max_concurrency=1)
    handles = [actor.remote(name), actor.remote(name)]
    source, destination = (RemotePeer(h) for h in handles)
    yield source, destination
    for handle in handles:
        try:
            ray.get(handle.close.remote(), timeout=30)
        finally:
            ray.kill(handle)


# -- one suite over every backend --------------------------------------------------------------


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: f"{s[1]}-{'x'.join(map(str, s[0]))}")
def test_fetch_is_an_exact_copy(peers, spec):
    source, destination = peers
    shape, dtype = spec
    handle = source.expose(shape, dtype, seed=7)
    assert (handle.shape, handle.dtype) == (shape, dtype)
    result = destination.fetch(handle, seed=7)
    source.release(handle)
    assert result["equal"] and result["bytes_equal"], f"{handle.transport}: copy differs for {spec}"
    assert result["nbytes"] == torch.empty(shape, dtype=getattr(torch, dtype)).nbytes


def test_repeated_fetches_reuse_registrations(peers):
    source, destination = peers
    handle = source.expose(SMOLLM2_77, "bfloat16", seed=3)
    first = destination.fetch(handle, seed=3)
    again = [destination.fetch(handle, seed=3) for _ in range(3)]
    source.release(handle)
    assert all(r["equal"] for r in [first, *again])
    assert {r["registrations"] for r in again} == {first["registrations"]}


def test_pool_slices_are_exposed_without_new_registrations(peers):
    source, destination = peers
    handles = [
        source.expose_from_pool(SMOLLM2_77, "bfloat16", seed, offset)
        for seed, offset in [(1, 0), (2, 1_000_003)]
    ]
    registered = source.registrations()
    handles.append(source.expose_from_pool(TINY, "bfloat16", 3, 3_000_001))
    assert source.registrations() == registered
    for handle, seed in zip(handles, [1, 2, 3], strict=True):
        assert destination.fetch(handle, seed=seed)["equal"]
        source.release(handle)
    source.drop_pool()  # a new pool (maybe at the old pool's address) must work too
    handle = source.expose_from_pool(SMOLLM2_77, "bfloat16", 4, 12_345)
    assert destination.fetch(handle, seed=4)["equal"]
    source.release(handle)


def test_memory_reused_after_release_is_fetched_correctly(peers):
    """Release, free, allocate again (the allocator reuses the addresses), expose, fetch:
    a destination must not read through a stale registration of the old tensor."""
    source, destination = peers
    for step, tokens in enumerate([512, 300, 700, 512, 100, 600]):
        handle = source.expose((30, 2, tokens, 3, 64), "bfloat16", seed=step)
        assert destination.fetch(handle, seed=step)["equal"], f"step {step}"
        source.release(handle)


def test_simultaneous_fetches_in_both_directions(peers):
    """Each endpoint serves a peer's fetch while it is itself fetching from that peer."""
    a, b = peers
    from_a, from_b = (
        a.expose(SMOLLM2_512, "bfloat16", seed=11),
        b.expose(SMOLLM2_512, "float32", seed=12),
    )
    if isinstance(a, RemotePeer):
        import ray

        refs = [b.start("fetch", from_a, 11), a.start("fetch", from_b, 12)]
        results = ray.get(refs, timeout=120)
    else:
        results = [b.fetch(from_a, 11), a.fetch(from_b, 12)]
    a.release(from_a)
    b.release(from_b)
    assert all(r["equal"] for r in results)


def test_handles_are_small_and_picklable(peers):
    source, _ = peers
    handle = source.expose(TINY, "float32")
    if handle.transport != "ray":  # an ObjectRef pickles only through Ray
        assert pickle.loads(pickle.dumps(handle)) == handle
        assert len(pickle.dumps(handle)) < 4096
    with pytest.raises(dataclasses.FrozenInstanceError):
        handle.nbytes = 1
    source.release(handle)


def _assert_fails_fast(result, match):
    kind, message, seconds = result
    assert kind == "KVTransferError", f"expected KVTransferError, got {kind}: {message}"
    assert match in message, message
    assert seconds < FAST_S, f"took {seconds:.1f} s: {message}"


def test_released_handle_raises_fast(peers):
    source, destination = peers
    handle = source.expose(SMOLLM2_77, "float32")
    assert destination.fetch(handle)["equal"]
    source.release(handle)
    source.release(handle)  # idempotent
    _assert_fails_fast(destination.fetch_error(handle), "released")


def test_forged_handle_raises_fast(peers):
    source, destination = peers
    handle = source.expose(TINY, "float32")
    forged = dataclasses.replace(handle, handle_id="0123456789abcdef" * 2)
    _assert_fails_fast(destination.fetch_error(forged), handle.transport)
    garbage_id = dataclasses.replace(handle, handle_id="not hex at all")
    _assert_fails_fast(destination.fetch_error(garbage_id), handle.transport)
    assert destination.fetch(handle)["equal"], "a good fetch must still work after failures"
    source.release(handle)


def test_damaged_handle_blobs_raise_fast(peers):
    """Truncated agent metadata / worker addresses must fail cleanly, not abort inside UCX."""
    source, destination = peers
    handle = source.expose(TINY, "float32")
    blobs = {
        f.name: getattr(handle, f.name)
        for f in dataclasses.fields(handle)
        if isinstance(getattr(handle, f.name), bytes)
    }
    for name, blob in blobs.items():
        for damaged in (blob[:-5], blob[: len(blob) // 2], b"garbage" * 8):
            changes = {
                name: damaged,
                **({"reg_id": "never-loaded"} if hasattr(handle, "reg_id") else {}),
            }
            _assert_fails_fast(
                destination.fetch_error(dataclasses.replace(handle, **changes)), "damaged"
            )
    assert destination.fetch(handle)["equal"], "a good fetch must still work after failures"
    source.release(handle)


def test_wrong_size_out_and_foreign_handles_raise_fast(peers):
    source, destination = peers
    handle = source.expose(TINY, "bfloat16")
    _assert_fails_fast(destination.fetch_error(handle, out_nbytes=handle.nbytes - 2), "bytes")
    _assert_fails_fast(destination.fetch_error(handle, out_nbytes=handle.nbytes + 2), "bytes")
    other = "ray" if handle.transport == "local" else "local"
    foreign = LocalHandle(other, "ab" * 16, handle.nbytes, handle.shape, handle.dtype, pid=0)
    _assert_fails_fast(destination.fetch_error(foreign), "handle")
    source.release(handle)


@pytest.mark.keeps_transports  # `reopen` gives the module's source peer a new endpoint
def test_handle_of_a_closed_source_raises(peers):
    source, destination = peers
    handle = source.expose(TINY, "float32")
    source.reopen()  # closes the endpoint that exposed `handle`
    kind, message, seconds = destination.fetch_error(handle, timeout_s=2.0)
    assert kind == "KVTransferError", message
    assert seconds < 2.0 + FAST_S, message
    fresh = source.expose(TINY, "float32", seed=5)
    assert destination.fetch(fresh, seed=5)["equal"]
    source.release(fresh)
