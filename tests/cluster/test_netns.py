"""Multi-host on one machine (issue 26, part 5): two network namespaces joined by a tbf-limited veth
link, a Ray node in each (`aaflow.cluster.netns.NetnsTestbed`), one replica of the tiny model on each. KV
moves from host 0 to host 1 over every installed transport across the real link and gives the
tokens that recomputing from tokens gives (fp32, greedy); the link runs at about the tbf rate; the
testbed listens only on addresses it made and leaves no namespace, link or process behind.

Skips with the reason where namespaces cannot be made here (not root, no iproute2, ...).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from aaflow.cluster.netns import NetnsTestbed
from aaflow.cluster.netns_layout import PREFIX, available, leftovers
from aaflow.cluster.netns_link import measure_link
from tests.cluster.transport_params import REMOTE_TRANSPORTS, transport_params, unavailable

RATE_MBIT = 200
_OK, _WHY = available()
pytestmark = pytest.mark.skipif(not _OK, reason=_WHY or "network namespaces unavailable")


@pytest.fixture(scope="module")
def testbed():
    bed = NetnsTestbed(hosts=2, rate_mbit=RATE_MBIT, object_store_bytes=256 << 20).start()
    try:
        yield bed
    finally:
        bed.close()


@pytest.fixture(scope="module")
def moved(testbed, tiny_llama_dir):
    """The probe's report: per installed transport, tokens after the moved KV and the reference."""
    names = [t for t in REMOTE_TRANSPORTS if unavailable(t) is None]
    out = testbed.run(0, [sys.executable, "-m", "tests.cluster.netns_probe", str(tiny_llama_dir), *names], timeout_s=240)
    assert out.returncode == 0, f"the probe inside {testbed.layout.hosts[0].netns} failed:\n{out.stderr[-3000:]}"
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_the_link_runs_at_about_the_tbf_rate(testbed):
    mbit = measure_link(testbed.layout, 0, 1, 4 << 20) * 8 / 1e6
    assert 0.6 * RATE_MBIT <= mbit <= 1.1 * RATE_MBIT, f"tbf {RATE_MBIT} Mbit/s, measured {mbit:.0f} Mbit/s"


def test_the_replicas_run_on_the_two_namespaced_hosts(testbed, moved):
    assert sorted(moved["replicas"].values()) == [h.address for h in testbed.layout.hosts]


@pytest.mark.parametrize("transport", transport_params())
def test_kv_moved_across_the_link_gives_the_recomputed_tokens(moved, transport):
    got = moved["transports"][transport]
    assert got["tokens"] == got["reference"], f"{transport}: moved KV gave {got['tokens']}, recompute {got['reference']}"
    assert got["link_tx_bytes"] >= got["kv_bytes"] > 0, (
        f"{transport}: host 0's link sent {got['link_tx_bytes']} bytes for {got['kv_bytes']} bytes of KV")


def test_a_deployment_given_no_actor_env_moves_kv_across_the_hosts_over_their_link(testbed, moved, tiny_llama_dir):
    """`af.up` on a cluster reached at a routable address leaves UCX and gloo to the hosts' settings
    (here the link's interface), not loopback's: the KV crosses the link and gives the same tokens."""
    names = [t for t in REMOTE_TRANSPORTS if unavailable(t) is None]
    out = testbed.run(0, [sys.executable, "-m", "tests.cluster.netns_probe", str(tiny_llama_dir), *names,
                          "--deployment"], timeout_s=240)
    assert out.returncode == 0, f"the probe inside {testbed.layout.hosts[0].netns} failed:\n{out.stderr[-3000:]}"
    report = json.loads(out.stdout.strip().splitlines()[-1])
    for name in names:
        got = report["transports"][name]
        assert got["tokens"] == got["reference"] == moved["transports"][name]["tokens"], name
        assert got["link_tx_bytes"] >= got["kv_bytes"] > 0, name


def test_the_testbed_listens_only_on_addresses_it_made(testbed):
    ours = {h.address for h in testbed.layout.hosts}
    for h in testbed.layout.hosts:
        addrs = subprocess.run(["ip", "-n", h.netns, "-o", "addr", "show"], capture_output=True, text=True,
                               check=True).stdout
        inet = {line.split()[3].split("/")[0] for line in addrs.splitlines()}
        assert inet <= {"127.0.0.1", "::1", h.address} and h.address in inet, f"{h.netns} has {inet}"
        routes = subprocess.run(["ip", "-n", h.netns, "route"], capture_output=True, text=True, check=True).stdout
        assert "default" not in routes, f"{h.netns} has a route out: {routes}"
    assert len(ours) == 2


def test_three_hosts_reach_each_other_at_the_rate_without_ray():
    with NetnsTestbed(hosts=3, rate_mbit=100, ray=False) as bed:
        mbit = {(a, b): measure_link(bed.layout, a, b, 2 << 20) * 8 / 1e6 for a, b in ((0, 2), (2, 1))}
        assert all(60 <= m <= 110 for m in mbit.values()), f"tbf 100 Mbit/s, measured {mbit}"
    names = {h.netns for h in bed.layout.hosts} | {bed.layout.hub}
    assert not names & set(leftovers()), f"left behind: {names & set(leftovers())}"


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


def test_teardown_leaves_no_namespace_link_or_process(testbed):
    """Runs last: closes the module's testbed and checks what is left."""
    namespaces = [h.netns for h in testbed.layout.hosts] + [testbed.layout.hub]
    pids = {int(p) for ns in namespaces for p in subprocess.run(["ip", "netns", "pids", ns], capture_output=True,
                                                                  text=True).stdout.split()}
    assert pids, "the Ray nodes should be running inside the namespaces"
    temp = testbed.temp_dir
    testbed.close()
    assert leftovers() == []
    links = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True, check=True).stdout
    assert PREFIX not in links, f"links left in the machine's namespace: {links}"
    assert not [p for p in pids if _alive(p)], f"processes left: {[p for p in pids if _alive(p)]}"
    assert not os.path.exists(temp)
