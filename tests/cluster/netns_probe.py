"""Run inside host 0 of a `aaflow.cluster.netns.NetnsTestbed` by `tests/cluster/test_netns.py`: one replica of a
model on each host's Ray node, the KV of a context moved from host 0 to host 1 over each transport
named in argv, and the tokens generated after it compared with recomputing from tokens on host 1.
Prints one JSON line: replica addresses and, per transport, tokens, reference tokens, KV bytes and
the bytes host 0's link interface sent during the transfer."""

from __future__ import annotations

import json
import os
import sys

import ray

import aaflow as af
from aaflow.cluster.netns_layout import DEVICE, Layout

QUESTION = [5, 17, 42, 9, 3, 11]  # token ids (valid in every test model's vocabulary)
CONTEXT = "Shared context: KV caches keep keys and values across agents on separate hosts. " * 6


def _tx_bytes() -> int:
    with open(f"/sys/class/net/{DEVICE}/statistics/tx_bytes") as f:  # /sys of this namespace (ip netns exec)
        return int(f.read())


def _node_ip(actor) -> str:
    return ray.get(actor.__ray_call__.remote(lambda self: ray.util.get_node_ip_address()), timeout=60)


def main(model: str, transports: list[str], deployment: bool = False) -> dict:
    """With `deployment`, the replicas are an `af.up` deployment given no `actor_env`: its UCX and
    gloo settings are the hosts' (the testbed's Ray nodes name the link's interface)."""
    layout = Layout.from_json(os.environ["AAFLOW_NETNS_LAYOUT"])
    options = dict(placement_strategy="STRICT_SPREAD", num_cpus=2, dtype="float32", kv_cache_bytes=8 * 2**20,
                   placement_timeout_s=60, load_timeout_s=120)
    if deployment:
        cluster = af.up({model: 2}, address=layout.ray_address, **options)
    else:
        cluster = af.init(replicas={model: 2}, address=layout.ray_address,
                          actor_env={"UCX_NET_DEVICES": DEVICE, "UCX_TLS": "tcp"}, **options)
    out: dict = {"transports": {}}
    try:
        where = {r.name: _node_ip(r.actor) for r in cluster.replicas()}
        src, dst = sorted(cluster.replicas(), key=lambda r: where[r.name])
        out["replicas"] = where
        for t in transports:
            kv = af.materialize(cluster, model, CONTEXT, replica=src)
            sent = _tx_bytes()
            moved = af.transfer(kv, dst, transport=t)
            sent = _tx_bytes() - sent
            got = af.generate(moved, QUESTION, max_new_tokens=8, ignore_eos=True)
            ref = ray.get(dst.actor.generate_text.remote(list(kv.token_ids) + QUESTION, 8, ignore_eos=True))
            out["transports"][t] = {"tokens": list(got.token_ids), "reference": list(ref.token_ids),
                                    "kv_bytes": kv.nbytes, "link_tx_bytes": sent, "moved_to": moved.replica.name}
            af.free(moved)
            af.free(kv)
    finally:
        cluster.shutdown()
        if deployment:
            af.down(layout.ray_address)
    return out


if __name__ == "__main__":
    args = sys.argv[1:]
    print(json.dumps(main(args[0], [a for a in args[1:] if a != "--deployment"], "--deployment" in args)))
