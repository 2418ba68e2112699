"""Workflows across two Ray "nodes" on one machine (`ray.cluster_utils.Cluster`, two raylets on
127.0.0.1): the replicas sit on different nodes, so KV handoffs cross a node boundary for real,
and every strategy still gives the text baseline's tokens for every agent (greedy decoding).

This module starts and stops its own Ray test cluster; it must not run while another module holds
Ray in this process (the driver would stay attached to that one).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys

import pytest

import aaflow as af
from tests.cluster.test_security import _listeners
from tests.cluster.transport_params import skip_unless
from tests.cluster_checks import DOC, assert_no_kv_left
from tests.cluster_checks import fixed_length_chain as chain

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

ray = pytest.importorskip("ray")

STRATEGIES = ["text", "transfer", "stream", "auto"]
LOOPBACK = ("127.0.0.1:", "[::ffff:127.0.0.1]:", "[::1]:")


def _node_id(actor) -> str:
    return ray.get(actor.__ray_call__.remote(lambda self: ray.get_runtime_context().get_node_id()), timeout=60)


@pytest.fixture(scope="module")
def two_nodes(tiny_llama_dir):
    """Two Ray nodes (1 CPU each) bound to loopback, and one replica of the tiny model on each."""
    from ray.cluster_utils import Cluster as RayTestCluster

    from aaflow.cluster.actors import default_temp_dir, loopback_only

    assert not ray.is_initialized(), "another test module left Ray running in this process"
    has_ss = shutil.which("ss") is not None
    before = _listeners() if has_ss else set()
    loopback_only()  # before any Ray process starts: every Ray server then binds 127.0.0.1
    # Ray's test cluster records its address in Ray's default temp folder (/tmp/ray), whatever
    # temp_dir the head uses, and fails where that folder was never created (a fresh machine).
    os.makedirs(os.path.dirname(ray._private.utils.get_ray_address_file(None)), exist_ok=True)
    # A dynamic dashboard-agent port: the default 52365 may be held by another Ray on this machine.
    ray_cluster = RayTestCluster(initialize_head=True, head_node_args={
        "num_cpus": 1, "node_ip_address": "127.0.0.1", "include_dashboard": False, "temp_dir": default_temp_dir(),
        "dashboard_agent_listen_port": 0})
    cluster = None
    try:
        ray_cluster.add_node(num_cpus=1, node_ip_address="127.0.0.1")
        ray_cluster.wait_for_nodes()
        cluster = af.init(replicas={str(tiny_llama_dir): 2}, address=ray_cluster.address, placement_strategy="SPREAD",
                          num_cpus=2, dtype="float32", kv_cache_bytes=8 * 2**20, placement_timeout_s=60,
                          load_timeout_s=120)
        listening = (_listeners() - before) if has_ss else None
        yield cluster, str(tiny_llama_dir), listening, ray_cluster.address
    finally:
        try:
            if cluster is not None:
                cluster.shutdown()  # joined an existing Ray: stops the replicas, leaves Ray to us
        finally:
            ray.shutdown()
            ray_cluster.shutdown()


def test_the_replicas_run_on_two_different_ray_nodes(two_nodes):
    cluster, *_ = two_nodes
    alive = [n for n in ray.nodes() if n["Alive"]]
    assert len(alive) == 2 and {n["NodeManagerAddress"] for n in alive} == {"127.0.0.1"}
    nodes = {r.name: _node_id(r.actor) for r in cluster.replicas()}
    assert len(set(nodes.values())) == 2, f"replicas share a node: {nodes}"
    assert set(nodes.values()) == {n["NodeID"] for n in alive}


def _descendants(root: int) -> set[int]:
    """`root` and every process below it (Ray's GCS and raylets here are children of this process)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    tree, todo = set(), [root]
    while todo:
        pid = todo.pop()
        tree.add(pid)
        todo.extend(children.get(pid, []))
    return tree


def _our_listeners() -> list[str] | None:
    """Listening addresses of this process tree, or None where `ss -p` shows no owners."""
    out = subprocess.run(["ss", "-ltnpH"], capture_output=True, text=True, check=True).stdout
    if "pid=" not in out:
        return None
    tree = _descendants(os.getpid())
    return [line.split()[3] for line in out.splitlines()
            if any(int(pid) in tree for pid in re.findall(r"pid=(\d+)", line))]


@pytest.mark.skipif(shutil.which("ss") is None, reason="needs `ss` (iproute2) to list listening sockets")
def test_the_two_node_cluster_listens_on_loopback_only(two_nodes):
    _, _, listening, _ = two_nodes
    ours = _our_listeners()
    if ours is None:  # no process owners visible: fall back to what appeared while the cluster started
        ours = listening
    assert len(ours) >= 4, f"both nodes' GCS / raylets / replicas should be listening: {ours}"
    exposed = [addr for addr in ours if not addr.startswith(LOOPBACK)]
    assert not exposed, f"listening beyond loopback: {exposed}"


JOIN = """
import sys
import ray
from aaflow.cluster.actors import start_ray
start_ray(address=sys.argv[1])
print(sorted(n["NodeManagerAddress"] for n in ray.nodes() if n["Alive"]))
ray.shutdown()
"""


def test_a_fresh_driver_joins_the_loopback_cluster_by_its_address(two_nodes):
    """A new process joining "127.0.0.1:port" must not be redirected to the machine's routable
    address (Ray's default), where nothing listens: that connect retried forever."""
    *_, address = two_nodes
    assert address.startswith("127.0.0.1:")
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "RAY_ADDRESS")}
    out = subprocess.run([sys.executable, "-c", JOIN, address], capture_output=True, text=True, timeout=60, cwd=ROOT,
                         env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "['127.0.0.1', '127.0.0.1']"


def map_reduce(model):
    wf = af.Workflow("map-reduce")
    paper = wf.context("paper", DOC)
    revs = [wf.agent(f"r{i}", model, [paper, f"Review aspect {i}."], max_tokens=10, ignore_eos=True) for i in range(2)]
    wf.agent("meta", model, [paper, *revs, "Meta-review."], max_tokens=10, ignore_eos=True)
    return wf


@pytest.mark.parametrize("build", [chain, map_reduce])
def test_every_strategy_gives_the_text_baselines_tokens_across_nodes(two_nodes, build):
    cluster, model, *_ = two_nodes
    wf = build(model)
    baseline = af.run(wf, cluster, strategy="text")
    assert all(a.decoded == len(a.token_ids) > 0 for a in baseline.agents.values())
    replicas = {r.name for r in cluster.replicas()}
    for strategy in STRATEGIES[1:]:
        res = af.run(wf, cluster, strategy=strategy)
        for name, agent in res.agents.items():
            assert agent.token_ids == baseline[name].token_ids, f"{wf.name}/{strategy}/{name} differs from text"
        if strategy == "transfer":
            used = {a.replica for a in res.agents.values()}
            assert used == replicas, f"transfer should use both nodes' replicas, used {used}"
            assert res.metrics["bytes_moved"] > 0, "no KV crossed the node boundary under transfer"
    assert_no_kv_left(cluster)


@skip_unless("nixl")
def test_nixl_moves_kv_across_nodes_exactly(two_nodes):
    """The same handoff with the NIXL transport (UCX over loopback between the two nodes' actors)."""
    cluster, model, *_ = two_nodes
    wf = chain(model)
    baseline = af.run(wf, cluster, strategy="text")
    res = af.run(wf, cluster, strategy="transfer", transport="nixl")
    assert {n: a.token_ids for n, a in res.agents.items()} == {n: a.token_ids for n, a in baseline.agents.items()}
    assert res.metrics["bytes_moved"] > 0
    assert_no_kv_left(cluster)

