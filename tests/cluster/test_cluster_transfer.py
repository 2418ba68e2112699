"""KV transfer between two model replicas in two Ray actor processes, per transport, on SmolLM2.

One shared suite over every transport that can run here: the received KV is byte-identical to
the sender's, greedy continuation after transfer equals recomputing from text, and a failed
transfer leaves both pools as they were. `local` (same process) is the reference.
"""

from __future__ import annotations

import pytest
import torch

import aaflow as af
from tests.cluster.transport_params import transport_params

pytestmark = pytest.mark.smollm2

CONTEXT = ("The Amazon rainforest covers much of the Amazon basin in South America. It spans nine "
           "countries, with the majority in Brazil, and holds an estimated 390 billion trees. ") * 4
QUESTION = "\nQuestion: which country holds most of the forest? Answer:"
REMOTE = transport_params()  # a transport not installed here is a skip naming its install command


@pytest.fixture(scope="module")
def replicas(smollm2_dir, tmp_path_factory):
    import ray

    from aaflow.cluster.actors import replica_actor, start_ray

    start_ray(num_cpus=2, temp_dir=None)
    a = replica_actor("src", str(smollm2_dir), num_cpus=0.5, dtype="bfloat16", threads=1, kv_cache_bytes=64 * 2**20)
    b = replica_actor("dst", str(smollm2_dir), num_cpus=0.5, dtype="bfloat16", threads=1, kv_cache_bytes=64 * 2**20)
    ray.get([a.info.remote(), b.info.remote()])
    yield a, b
    ray.get([a.close.remote(), b.close.remote()])
    ray.shutdown()


def _pools_empty(ray, *actors):
    return [ray.get(x.stats.remote())["used_blocks"] for x in actors]


@pytest.mark.parametrize("transport", REMOTE)
def test_transfer_is_byte_identical_and_continues_like_recompute(replicas, transport):
    import ray

    src, dst = replicas
    info_src, info_dst = ray.get([src.info.remote(), dst.info.remote()])
    assert info_src["pid"] != info_dst["pid"], "the two replicas must be two processes"
    record = ray.get(src.materialize.remote(CONTEXT))
    exposure = ray.get(src.expose.remote(record.id, transport))
    handle, shape, record = exposure.handle, exposure.shape, exposure.record
    answer = ray.get(dst.receive.remote(handle, shape, record, transport))
    received, stats = answer.record, answer.stats
    ray.get(src.release.remote(handle, transport))
    assert stats.nbytes == record.nbytes and stats.bandwidth_bytes_per_s > 0
    assert torch.equal(ray.get(src.export_tensor.remote(record.id)), ray.get(dst.export_tensor.remote(received.id)))
    after_transfer = ray.get(dst.generate.remote(received.id, QUESTION, 16))
    recomputed = ray.get(dst.generate_text.remote(CONTEXT + QUESTION, 16))
    assert after_transfer.token_ids == recomputed.token_ids, (after_transfer.text, recomputed.text)
    ray.get([src.free.remote(record.id), dst.free.remote(received.id)])
    assert _pools_empty(ray, src, dst) == [0, 0]


@pytest.mark.parametrize("transport", REMOTE)
def test_a_failed_transfer_raises_and_leaves_both_pools_consistent(replicas, transport):
    import ray

    src, dst = replicas
    record = ray.get(src.materialize.remote(CONTEXT))
    exposure = ray.get(src.expose.remote(record.id, transport))
    handle, shape, record = exposure.handle, exposure.shape, exposure.record
    ray.get(src.release.remote(handle, transport))  # stale: the peer no longer exposes it
    with pytest.raises(af.KVTransferError):
        ray.get(dst.receive.remote(handle, shape, record, transport, 5.0))
    assert ray.get(dst.stats.remote())["refs"] == 0
    ray.get(src.free.remote(record.id))
    assert _pools_empty(ray, src, dst) == [0, 0]


def test_receiver_checks_model_and_shape_before_any_byte(replicas):
    import ray

    from aaflow.cluster.receive_checks import KVShape

    src, dst = replicas
    record = ray.get(src.materialize.remote(CONTEXT))
    exposure = ray.get(src.expose.remote(record.id, "ray"))
    handle, shape, record = exposure.handle, exposure.shape, exposure.record
    wrong_model = KVShape("0" * 64, shape.shape, shape.dtype)
    with pytest.raises(af.ModelMismatchError):
        ray.get(dst.receive.remote(handle, wrong_model, record, "ray"))
    wrong_shape = KVShape(shape.fingerprint, (1, 2, 3), shape.dtype)
    with pytest.raises(af.KVImportError):
        ray.get(dst.receive.remote(handle, wrong_shape, record, "ray"))
    ray.get(src.release.remote(handle, "ray"))
    ray.get(src.free.remote(record.id))
    assert _pools_empty(ray, src, dst) == [0, 0]
