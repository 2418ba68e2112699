"""Nothing aaflow starts listens beyond loopback by default."""

from __future__ import annotations

import shutil
import subprocess

import pytest

import aaflow as af


def _listeners() -> set[str]:
    out = subprocess.run(["ss", "-ltnH"], capture_output=True, text=True, check=True).stdout
    return {line.split()[3] for line in out.splitlines() if line.strip()}


@pytest.mark.skipif(shutil.which("ss") is None, reason="needs `ss` (iproute2) to list listening sockets")
def test_a_local_cluster_listens_on_loopback_only(tiny_llama_dir):
    before = _listeners()
    cluster = af.init(replicas={str(tiny_llama_dir): 1}, num_cpus=1, dtype="float32", kv_cache_bytes=4 * 2**20)
    try:
        new = _listeners() - before
        assert new, "Ray should be listening on something"
        exposed = [addr for addr in new if not addr.startswith(("127.0.0.1:", "[::ffff:127.0.0.1]:", "[::1]:"))]
        assert not exposed, f"listening beyond loopback: {exposed}"
    finally:
        cluster.shutdown()
