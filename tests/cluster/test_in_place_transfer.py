"""KV moved pool to pool with no staging copy (`nixl`'s scatter lists): the segments a pool
reports, the pairing of two scatter lists, exact in-place copies between two NIXL agents, and two
replicas moving a ref this way, including after the source freed it."""

from __future__ import annotations

import pytest
import torch

from aaflow.engine.kv_cache import KVLayout, PagedKVCache
from aaflow.common.errors import KVTransferError
from aaflow.cluster.transports import get_transport
from tests.cluster.transport_params import skip_unless
from aaflow.cluster.transports.segments import pair_up

NIXL = skip_unless("nixl")


def _bytes_at(buffer: torch.Tensor, segments) -> torch.Tensor:
    """The bytes of `buffer` under a scatter list, concatenated."""
    flat, base = buffer.view(-1).view(torch.uint8), buffer.data_ptr()
    return torch.cat([flat[a - base:a - base + n] for a, n in segments])


def test_pair_up_splits_both_lists_at_each_others_boundaries():
    local, remote = pair_up([(100, 10), (200, 5)], [(0, 4), (50, 11)])
    assert local == [(100, 4), (104, 6), (200, 5)]
    assert remote == [(0, 4), (50, 6), (56, 5)]
    with pytest.raises(ValueError, match="differ in size"):
        pair_up([(0, 4)], [(0, 5)])


def test_byte_segments_are_read_tokens_in_place():
    cache = PagedKVCache(KVLayout(num_layers=3, num_blocks=8, block_size=4, num_kv_heads=2, head_dim=5,
                                  dtype=torch.bfloat16))
    cache.tensor.copy_(torch.randn(cache.tensor.shape))
    slots = torch.tensor([8, 9, 10, 11, 0, 1, 2, 20, 21])  # three runs, out of order
    segments = cache.byte_segments(slots)
    assert len(segments) == 3 * 2 * 3  # a run per layer and K/V
    assert torch.equal(_bytes_at(cache.tensor, segments), cache.read_tokens(slots).view(-1).view(torch.uint8))


@NIXL
def test_nixl_copies_a_scatter_list_into_another_exactly():
    source, destination = get_transport("nixl"), get_transport("nixl")
    try:
        src_pool = torch.randint(0, 255, (1 << 20,), dtype=torch.uint8)
        dst_pool = torch.zeros(1 << 20, dtype=torch.uint8)
        source.register_pool(src_pool)
        destination.register_pool(dst_pool)
        base, dst = src_pool.data_ptr(), dst_pool.data_ptr()
        src_segments = [(base + 4096, 3000), (base + 500_000, 100_000), (base + 10, 7)]
        dst_segments = [(dst + 900_000, 50_007), (dst + 20, 53_000)]
        handle = source.expose_segments(src_pool, src_segments, (103_007,), torch.uint8)
        stats = destination.fetch_segments(handle, dst_pool, dst_segments, timeout_s=10)
        assert stats.nbytes == 103_007
        assert torch.equal(_bytes_at(dst_pool, dst_segments), _bytes_at(src_pool, src_segments))
        assert int(dst_pool[:20].sum()) == 0, "bytes outside the segments must stay untouched"

        forged = type(handle)(**{**handle.__dict__, "segments": ((base, 103_007),), "addr": base})
        with pytest.raises(KVTransferError, match="forged or corrupted"):
            destination.fetch_segments(forged, dst_pool, dst_segments, timeout_s=5)
        with pytest.raises(KVTransferError, match="segments hold"):
            destination.fetch_segments(handle, dst_pool, dst_segments[:1], timeout_s=5)
        with pytest.raises(ValueError, match="outside the registered buffer"):
            destination.fetch_segments(handle, dst_pool, [(base, 103_007)], timeout_s=5)
        source.release(handle)
        with pytest.raises(KVTransferError, match="released or unknown"):
            destination.fetch_segments(handle, dst_pool, dst_segments, timeout_s=5)
    finally:
        source.close()
        destination.close()


@pytest.fixture
def two_replicas(tiny_llama_dir):
    from aaflow.cluster.replica import ModelReplica

    pair = [ModelReplica(name, str(tiny_llama_dir), dtype="float32", num_blocks=64) for name in ("src", "dst")]
    yield pair
    for replica in pair:
        replica.close()


@NIXL
def test_replicas_move_kv_in_place_even_after_the_source_ref_is_freed(two_replicas):
    src, dst = two_replicas
    record = src.materialize(list(range(3, 90)))
    original = src.export_tensor(record.id)
    exposure = src.expose(record.id, "nixl")
    handle, shape, record = exposure.handle, exposure.shape, exposure.record
    assert handle.segments, "nixl exposes the KV where it lies in the pool"
    src.free(record.id)  # the exposure holds its blocks: new work must not overwrite them
    scratch = src.materialize(list(range(200, 300)))
    answer = dst.receive(handle, shape, record, "nixl")
    received, stats = answer.record, answer.stats
    src.release(handle, "nixl")
    assert torch.equal(dst.export_tensor(received.id), original)
    assert not (src.endpoint._send_busy or src.endpoint._send_free or dst.endpoint._recv_buffers), "no staging buffer was used"
    assert stats.nbytes == original.nbytes
    src.free(scratch.id)
    dst.free(received.id)
    assert src.stats()["used_blocks"] == dst.stats()["used_blocks"] == 0


@NIXL
def test_a_failed_in_place_fetch_frees_what_it_reserved(two_replicas):
    src, dst = two_replicas
    record = src.materialize(list(range(3, 60)))
    exposure = src.expose(record.id, "nixl")
    handle, shape, record = exposure.handle, exposure.shape, exposure.record
    src.release(handle, "nixl")
    with pytest.raises(KVTransferError):
        dst.receive(handle, shape, record, "nixl", timeout_s=5)
    assert dst.stats()["used_blocks"] == 0 and dst.stats()["refs"] == 0
    src.free(record.id)


def test_an_in_place_link_costs_the_source_no_staging_copy():
    from aaflow.costmodel.edge import EdgeCase, predict_edge
    from aaflow.costmodel.hardware import HardwareProfile, LinkProfile, load_hardware
    from aaflow.costmodel.model_profile import KNOWN_MODELS

    model, hw = KNOWN_MODELS["smollm2"], load_hardware("a100-80gb")
    compute = hw.compute_for(model)
    case = EdgeCase(4096, 8, 5, 4, 3, chunk_tokens=2)
    nbytes = 4096 * model.kv_bytes_per_token
    staged, in_place = LinkProfile(1e9, 1e-3), LinkProfile(1e9, 1e-3, in_place=True)
    assert staged.source_copy_time(nbytes, 1e9) == nbytes / 1e9 and in_place.source_copy_time(nbytes, 1e9) == 0
    ends = [predict_edge(case, compute, compute, model, link, 1e9)["transfer"] for link in (staged, in_place)]
    assert ends[1].end_s < ends[0].end_s
    saved = hw.with_link("nixl", in_place).to_dict()
    assert HardwareProfile.from_dict(saved).links["nixl"].in_place is True
    saved["links"]["nixl"]["in_place"] = "yes"
    with pytest.raises(Exception, match="in_place must be true or false"):
        HardwareProfile.from_dict(saved)
