"""The link emulator (`BASE@BANDWIDTH[,LATENCY]` transports): slow enough, exact, typed errors.

Runs in one process over the `local` transport (in-process fetch); timing checks are lower
bounds, or comparisons with a 10x margin, since this machine is noisy.
"""

from __future__ import annotations

import time

import pytest
import torch

from aaflow.common.errors import KVTransferError
from aaflow.cluster.transports import EmulatedLink, get_transport
from aaflow.cluster.transports.emulated import parse_link_spec
from tests.cluster.transport_params import skip_unless

MIB8 = 8 * 2**20


def _tensor(nbytes: int, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=generator)


def _timed_fetch(link, handle, nbytes: int, timeout_s: float = 30.0):
    out = torch.empty(nbytes, dtype=torch.uint8)
    start = time.perf_counter()
    stats = link.fetch(handle, out, timeout_s=timeout_s)
    return out, stats, time.perf_counter() - start


@pytest.mark.parametrize(
    "spec, expected",
    [
        ("ray@10Gbps", ("ray", 1.25e9, 0.0)),
        ("nixl@1Gbps,50us", ("nixl", 1.25e8, 5e-5)),
        ("nixl@25Gb/s,20µs", ("nixl", 3.125e9, 2e-5)),
        ("ucx@2.5GB/s,2ms", ("ucx", 2.5e9, 2e-3)),
        ("local@100Mbps,0.1s", ("local", 1.25e7, 0.1)),
        ("local@800MB/s, 1ns", ("local", 8e8, 1e-9)),
        ("local@1.5GiB/s,0.5", ("local", 1.5 * 2**30, 0.5)),
    ],
)
def test_parse_link_spec(spec, expected):
    base, bytes_per_s, latency_s = parse_link_spec(spec)
    assert base == expected[0]
    assert bytes_per_s == pytest.approx(expected[1])
    assert latency_s == pytest.approx(expected[2])


@pytest.mark.parametrize(
    "spec",
    ["local@", "@10Gbps", "local@fast", "local@10Gbps,soon", "local@10 parsecs", "local@0Gbps",
     "local@10Gbps,-1ms", "local@10Gbps@1ms", "local@10GB", "local@,1ms"],
)
def test_bad_spec_raises_value_error_naming_it(spec):
    with pytest.raises(ValueError, match="BASE@BANDWIDTH") as info:
        get_transport(spec)
    assert repr(spec) in str(info.value)


def test_unknown_base_raises_value_error():
    with pytest.raises(ValueError, match="unknown transport"):
        get_transport("nosuch@10Gbps")


def test_100mbps_is_slow_and_exact():
    link = get_transport("local@100Mbps")
    assert isinstance(link, EmulatedLink) and link.name == "local@100Mbps"
    source = _tensor(MIB8)
    handle = link.expose(source)
    out, stats, wall = _timed_fetch(link, handle, MIB8)
    floor = MIB8 * 8 / 1e8
    assert wall >= floor and stats.seconds >= floor
    assert stats.transport == "local@100Mbps" and stats.nbytes == MIB8
    assert torch.equal(out, source)
    link.release(handle)
    with pytest.raises(KVTransferError):
        link.fetch(handle, torch.empty(MIB8, dtype=torch.uint8))
    link.close()


def test_faster_link_is_faster_and_base_handles_work():
    base = get_transport("local")
    source = _tensor(MIB8, seed=1)
    handle = base.expose(source)  # a plain endpoint exposes, emulated links fetch
    slow, fast = get_transport("local@100Mbps"), get_transport("local@1Gbps")
    out_slow, _, wall_slow = _timed_fetch(slow, handle, MIB8)
    out_fast, stats_fast, wall_fast = _timed_fetch(fast, handle, MIB8)
    assert torch.equal(out_slow, source) and torch.equal(out_fast, source)
    assert wall_fast >= MIB8 * 8 / 1e9 and stats_fast.transport == "local@1Gbps"
    assert wall_fast < wall_slow
    for transport in (slow, fast, base):
        transport.close()


def test_latency_is_added_on_a_tiny_tensor():
    link = get_transport("local@100GB/s,50ms")
    source = _tensor(16, seed=2)
    handle = link.expose(source)
    out, stats, wall = _timed_fetch(link, handle, 16)
    assert wall >= 0.05 and stats.seconds >= 0.05
    assert torch.equal(out, source)
    link.close()


def test_timeout_shorter_than_the_link_raises_after_the_deadline():
    link = get_transport("local@100Mbps")  # 0.67 s for 8 MiB
    handle = link.expose(_tensor(MIB8))
    start = time.perf_counter()
    with pytest.raises(KVTransferError, match="timed out"):
        link.fetch(handle, torch.empty(MIB8, dtype=torch.uint8), timeout_s=0.2)
    elapsed = time.perf_counter() - start
    assert 0.2 <= elapsed < MIB8 * 8 / 1e8
    link.close()


def test_wrong_handle_and_closed_link_raise_typed_errors():
    link = get_transport("local@1Gbps")
    handle = link.expose(_tensor(64))
    with pytest.raises(KVTransferError, match="bytes"):
        link.fetch(handle, torch.empty(32, dtype=torch.uint8))
    with pytest.raises(KVTransferError, match="not a"):
        link.fetch(object(), torch.empty(64, dtype=torch.uint8))
    link.close()
    with pytest.raises(KVTransferError, match="closed"):
        link.fetch(handle, torch.empty(64, dtype=torch.uint8))


@skip_unless("nixl")
def test_nixl_spec_wraps_a_nixl_transport():
    link = get_transport("nixl@1Gbps,50us")
    try:
        assert isinstance(link, EmulatedLink) and link.base.name == "nixl"
        assert link.bandwidth_bytes_per_s == pytest.approx(1.25e8)
        assert link.latency_s == pytest.approx(5e-5)
    finally:
        link.close()


def test_default_name_is_a_parseable_spec():
    link = EmulatedLink(get_transport("local"), 1.25e8, 5e-5)
    assert parse_link_spec(link.name) == ("local", pytest.approx(1.25e8), pytest.approx(5e-5))
    link.close()
