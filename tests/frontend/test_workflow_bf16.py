"""bf16, deterministic engines: every strategy gives the text baseline's tokens, as in fp32.

Strategies compute the same tokens in different passes (one-pass prefill, prefix-cache hits,
streamed chunks, packed prompts, batched decode, transferred KV); only batch- and chunk-invariant
kernels make that exact in bf16. SmolLM2's real weights and shapes, on a real local Ray cluster."""

from __future__ import annotations

import pytest

import aaflow as af
from aaflow.engine.dtypes import native_bf16
from tests.cluster_checks import assert_no_kv_left
from tests.frontend.test_workflow_run import STRATEGIES, chain, map_reduce

pytestmark = pytest.mark.smollm2


@pytest.fixture(scope="module")
def bf16_cluster(smollm2_dir):
    from aaflow.cluster.calibration import ensure_profile

    cluster = af.init(replicas={str(smollm2_dir): 2}, num_cpus=2, dtype="bfloat16", deterministic=True,
                      kv_cache_bytes=64 * 2**20)
    ensure_profile(cluster)
    yield cluster, str(smollm2_dir)
    cluster.shutdown()


# map-reduce (one document read by three agents decoding in one batch, then a join over their answers)
# and chain (streamed and transferred hand-offs); fan-out and fan-in are map-reduce's halves. fp32 runs
# all four (test_workflow_run.py).
@pytest.mark.skipif(not native_bf16(), reason="bf16 is emulated on this CPU (no AMX or AVX512-BF16; `auto` runs "
                    "fp32 here), a shape takes over a minute: the engine's bf16 invariance tests run instead "
                    "(test_engine_deterministic.py)")
@pytest.mark.parametrize("build", [map_reduce, chain])
def test_every_strategy_gives_the_text_baselines_tokens_in_bf16(bf16_cluster, build):
    cluster, model = bf16_cluster
    wf = build(model)
    baseline = af.run(wf, cluster, strategy="text")
    for strategy in STRATEGIES[1:]:
        res = af.run(wf, cluster, strategy=strategy)
        for name, agent in res.agents.items():
            assert agent.token_ids == baseline[name].token_ids, f"{wf.name}/{strategy}/{name} differs from text"
    assert_no_kv_left(cluster)
