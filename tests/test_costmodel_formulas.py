"""The analytical cost model: hand-computed values, closed forms against loops, fits, YAML profiles.

Pure and fast: no Ray, no model weights.
"""

from __future__ import annotations

import json
import math
import random
import subprocess
import sys
from dataclasses import replace

import numpy as np
import pytest

from aaflow.errors import CostModelError
from costmodel.calibration import (compute_profile_from_samples, fit_decode, fit_link, fit_prefill, fit_quality,
                                  with_member_cost)
from costmodel.edge import EdgeCase, predict_edge
from costmodel.hardware import (ComputeProfile, HardwareProfile, LinkProfile, available_hardware, hardware_dir,
                                load_hardware)
from costmodel.model_profile import KNOWN_MODELS, ModelProfile, estimate_params, model_profile
from costmodel.units import format_bandwidth, format_seconds, gbps, parse_bandwidth, parse_duration
from costmodel.whatif import (break_even_bandwidth, break_even_bandwidth_flops, break_even_context,
                              transfer_speedup)

LLAMA3_8B_CONFIG = {"model_type": "llama", "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
                    "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 128256,
                    "tie_word_embeddings": False}
QWEN3_8B_CONFIG = {"model_type": "qwen3", "hidden_size": 4096, "intermediate_size": 12288, "num_hidden_layers": 36,
                   "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 151936,
                   "tie_word_embeddings": False}
SMOLLM2_CONFIG = {"model_type": "llama", "hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30,
                  "num_attention_heads": 9, "num_key_value_heads": 3, "vocab_size": 49152,
                  "tie_word_embeddings": True}
# simple numbers for hand-computed timelines: prefill 1 s + 0.1 s/token, decode 0.5 s/step
SIMPLE = ComputeProfile(1.0, 0.1, 0.0, 0.5, 0.0, 0.0)
REALISTIC = ComputeProfile(2e-3, 1.2645e-4, 4.726e-9, 8.5e-3, 1.2592e-4, 7.232e-8)  # the A100 qwen3-8b entry


# --- units -------------------------------------------------------------------------------
@pytest.mark.parametrize("text, expected", [
    ("25Gbps", 3.125e9), ("25 Gb/s", 3.125e9), ("100 Mbps", 12.5e6), ("3GB/s", 3e9), ("3 GBps", 3e9),
    ("500MB/s", 5e8), ("1.5 GiB/s", 1.5 * 2**30), (3e9, 3e9), (7, 7.0), ("2e9", 2e9),
])
def test_parse_bandwidth(text, expected):
    assert parse_bandwidth(text) == pytest.approx(expected, rel=1e-12), f"{text!r} -> {parse_bandwidth(text)}"


@pytest.mark.parametrize("bad", ["25 furlongs", "fast", "25G", "-3GB/s", "0Gbps", ""])
def test_parse_bandwidth_rejects_naming_the_value(bad):
    with pytest.raises(CostModelError, match="bandwidth") as info:
        parse_bandwidth(bad)
    assert repr(bad) in str(info.value)


def test_parse_duration_and_gbps():
    assert gbps(25) == 3.125e9
    for text, seconds in [("50us", 50e-6), ("50µs", 50e-6), ("1ms", 1e-3), ("0.2s", 0.2), (0.3, 0.3), ("10ns", 1e-8)]:
        assert parse_duration(text) == pytest.approx(seconds), text
    with pytest.raises(CostModelError, match="'1 fortnight'"):
        parse_duration("1 fortnight")


def test_format():
    assert format_bandwidth(3.125e9) == "3.12 GB/s (25.0 Gbps)"
    assert format_seconds(0.0123) == "12.3 ms"
    assert format_seconds(1.2) == "1.20 s"
    assert format_seconds(45e-6) == "45 µs"


# --- model profiles ----------------------------------------------------------------------
def test_kv_bytes_and_flops_per_token():
    llama = model_profile("llama-3-8b")
    assert llama.kv_bytes_per_token == 32 * 2 * 8 * 128 * 2 == 131072
    assert model_profile("smollm2").kv_bytes_per_token == 30 * 2 * 3 * 64 * 2 == 23040
    assert llama.flops_per_token == pytest.approx(16.06e9, rel=1e-3)
    assert llama.weight_bytes == 2 * 8_030_261_248
    assert llama.attention_flops_per_token_per_context_token == 4 * 32 * 32 * 128
    with pytest.raises(CostModelError, match="llama-3-8b"):
        model_profile("gpt-5")


@pytest.mark.parametrize("name, config", [("llama-3-8b", LLAMA3_8B_CONFIG), ("qwen3-8b", QWEN3_8B_CONFIG),
                                          ("smollm2", SMOLLM2_CONFIG)])
def test_from_hf_config_matches_known(name, config):
    assert estimate_params(config) == KNOWN_MODELS[name].params
    assert ModelProfile.from_hf_config(name, config) == KNOWN_MODELS[name]
    assert ModelProfile.from_hf_config(name, config, dtype="float32").kv_bytes_per_token == \
        2 * KNOWN_MODELS[name].kv_bytes_per_token


def test_from_folder_counts_safetensors_params(tmp_path):
    safetensors_numpy = pytest.importorskip("safetensors.numpy")
    config = dict(SMOLLM2_CONFIG, num_hidden_layers=2)
    (tmp_path / "config.json").write_text(json.dumps(config))
    safetensors_numpy.save_file({"a": np.zeros((3, 5), np.float32), "b": np.zeros(7, np.float32)},
                                str(tmp_path / "model.safetensors"))
    profile = ModelProfile.from_folder("tiny", tmp_path)
    assert profile.params == 22 and profile.layers == 2 and profile.kv_bytes_per_token == 2 * 2 * 3 * 64 * 2
    with pytest.raises(CostModelError, match="config.json"):
        ModelProfile.from_folder("none", tmp_path / "missing")


# --- compute closed forms ----------------------------------------------------------------
def test_prefill_and_decode_closed_forms_match_loops():
    p = REALISTIC
    n, ctx = 100, 300
    per_token_loop = sum(p.prefill_s_per_token + p.prefill_s_per_token_ctx * (ctx + i) for i in range(n))
    assert p.prefill_time(n, ctx) == pytest.approx(p.prefill_fixed_s + per_token_loop, rel=1e-12)
    assert p.prefill_time(0, ctx) == 0.0
    loop = sum(p.decode_step_time(4, 500 + j) for j in range(37))
    assert p.decode_time(37, 4, 500) == pytest.approx(loop, rel=1e-12)
    assert p.decode_time(0, 4, 500) == 0.0
    chunks, c, left = 0.0, 300, 100
    while left:
        take = min(16, left)
        chunks += p.prefill_time(take, c)
        c, left = c + take, left - take
    assert p.chunked_prefill_time(100, 300, 16) == pytest.approx(chunks, rel=1e-12)


def test_monotone_in_context_and_bandwidth():
    times = [REALISTIC.prefill_time(n) for n in range(0, 5000, 97)]
    assert times == sorted(times), "a longer context made prefill faster"
    assert all(REALISTIC.prefill_time(64, c) <= REALISTIC.prefill_time(64, c + 50) for c in range(0, 3000, 50))
    model = KNOWN_MODELS["qwen3-8b"]
    case = EdgeCase(2048, 64, 200, 32, 50)
    ends = [predict_edge(case, REALISTIC, REALISTIC, model, LinkProfile(bw, 5e-6), 1e12)["transfer"].end_s
            for bw in (1e8, 1e9, 3e9, 1e10, 1e11, 1e12)]
    assert all(a >= b for a, b in zip(ends, ends[1:])), f"more bandwidth made transfer slower: {ends}"


def test_a100_qwen3_entry_matches_flashagents_figures():
    entry = load_hardware("a100-80gb").compute["qwen3-8b"]
    assert entry.prefill_tokens_per_s == pytest.approx(7644, rel=5e-3)
    assert 32 / entry.decode_step_time(32) == pytest.approx(2554, rel=5e-3)


# --- edge predictions --------------------------------------------------------------------
def _edge(case, model=KNOWN_MODELS["smollm2"]):
    nbytes = case.context_tokens * model.kv_bytes_per_token
    link = LinkProfile(bandwidth_bytes_per_s=nbytes / 2)  # 2 s to fetch C
    return predict_edge(case, SIMPLE, SIMPLE, model, link, memcpy_bytes_per_s=nbytes / 1)  # 1 s to copy C


def test_edge_hand_computed_across_replicas():
    got = _edge(EdgeCase(32, 8, 5, 4, 3, chunk_tokens=2))
    # A: prefill 40 -> 5.0 s, tokens at 5, 5.5, 6, 6.5, 7. B's prompt 41 tokens, 2 decode steps after its first.
    expected = {"text-nocache": (12.1, 5.1), "text": (12.1, 5.1), "recompute": (12.1, 5.1),
                # Q: C done 4.2; chunk [1,2] at 5.5 -> 6.7; chunk [3,4] 6.7 -> 7.9; last 5 tokens 7.9 -> 9.4
                "stream": (9.4, 2.4),
                # P: C 4.2, copy -> 5.2, u 1.8 -> A tokens 7..9; Q fetch 5.2 -> 7.2; B prefill 9 at 9 -> 10.9
                "transfer": (10.9, 1.9),
                # chunk at 7.5 -> 8.7; 8.7 -> 9.9; last 9.9 -> 11.4
                "transfer+stream": (11.4, 2.4)}
    assert set(got) == set(expected)
    for strategy, (ttft, handoff) in expected.items():
        p = got[strategy]
        assert (p.consumer_ttft_s, p.handoff_s, p.end_s) == pytest.approx((ttft, handoff, ttft + 1.0)), strategy
    assert got["transfer"].bytes_moved == got["transfer+stream"].bytes_moved == 32 * 23040
    assert got["text"].bytes_moved == got["stream"].bytes_moved == 0


def test_edge_hand_computed_same_replica():
    got = _edge(EdgeCase(40, 8, 5, 4, 3, same_replica=True, chunk_tokens=2))
    # A: prefill 48 -> 5.8, last token 7.8; B runs after it. The prefix cache holds 32 of C's 40 tokens.
    # With transfer, C is materialized alone (5.0) and forked: A's u -> 6.8, last token 8.8.
    expected = {"text-nocache": 7.8 + 5.9,  # all 49 tokens
                "text": 7.8 + 2.7,  # 17 tokens after the 32 cached
                "recompute": 7.8 + 2.7,
                "stream": 7.8 + 1.8 + 1.2 + 1.2 + 1.5,  # rest of C (8), two chunks of 2, last 1 + 4 tokens
                "transfer": 8.8 + 1.9,  # O + t = 9 tokens after the forked C
                "transfer+stream": 8.8 + 1.2 + 1.2 + 1.5}
    for strategy, ttft in expected.items():
        assert got[strategy].consumer_ttft_s == pytest.approx(ttft), strategy
        assert got[strategy].bytes_moved == 0, strategy


def test_stream_never_worse_than_text_when_consumer_idle():
    rng = random.Random(0)
    for _ in range(200):
        case = EdgeCase(rng.randrange(0, 8000), rng.randrange(0, 500), rng.randrange(1, 800), rng.randrange(0, 300),
                        rng.randrange(1, 200), chunk_tokens=rng.choice([8, 16, 64, 256]))
        got = predict_edge(case, REALISTIC, REALISTIC, KNOWN_MODELS["qwen3-8b"], None, 1e12)
        assert got["stream"].end_s <= got["text"].end_s + 1e-12, case
        assert got["recompute"].end_s == got["text"].end_s  # no prefix cache across replicas
        assert "transfer" not in got  # no link


def test_different_models_move_only_tokens():
    other = ComputeProfile(1e-3, 3e-5, 1e-9, 2e-3, 1e-5, 1e-8)
    got = predict_edge(EdgeCase(1000, 10, 100, 20, 10, same_model=False), other, REALISTIC,
                       KNOWN_MODELS["qwen3-8b"], LinkProfile(1e10), 1e12)
    assert set(got) == {"text-nocache", "text", "recompute", "stream"}
    with pytest.raises(CostModelError, match="same_replica"):
        EdgeCase(1, 1, 1, 1, 1, same_replica=True, same_model=False)
    with pytest.raises(CostModelError, match="upstream_output_tokens"):
        EdgeCase(1, 1, 0, 1, 1)


# --- break-even what-ifs -----------------------------------------------------------------
def test_break_even_bandwidth_hand_check():
    llama = model_profile("llama-3-8b")
    bw = break_even_bandwidth_flops(llama, 312e12)
    assert bw == pytest.approx(2.55e9, rel=0.02)
    assert bw * 8 / 1e9 == pytest.approx(20.4, rel=0.02)
    compute = ComputeProfile(0.0, llama.flops_per_token / 312e12, 0.0, 0.01, 0.0, 0.0)
    assert break_even_bandwidth(llama, compute, 4096) == pytest.approx(bw, rel=1e-9)


def test_break_even_context_and_speedup():
    model = KNOWN_MODELS["qwen3-8b"]
    compute = ComputeProfile(0.0, 1.2645e-4, 4.726e-9, 8.5e-3, 1.2592e-4, 7.232e-8)  # no fixed term
    results = []
    for bw in (1e8, 3e8, 1e9, 3e9, 1e10):
        link = LinkProfile(bw, 1e-3)
        c = break_even_context(model, compute, link)
        results.append(math.inf if c is None else c)
        if c is not None:  # exact crossover
            assert link.transfer_time(c * model.kv_bytes_per_token) < compute.prefill_time(c)
            assert c == 1 or link.transfer_time((c - 1) * model.kv_bytes_per_token) >= compute.prefill_time(c - 1)
            assert transfer_speedup(model, compute, link, c) > 1
    assert results == sorted(results, reverse=True), f"more bandwidth raised the break-even context: {results}"
    assert results[-1] < results[0]


# --- calibration fits --------------------------------------------------------------------
def test_fits_recover_known_coefficients():
    rng = np.random.default_rng(0)
    truth = REALISTIC
    noise = lambda: 1 + rng.normal(0, 0.005)  # noqa: E731
    prefill = [(n, c, truth.prefill_time(n, c) * noise()) for n in (16, 32, 64, 128, 256, 512, 1024, 2048)
               for c in (0, 512, 2048, 8192)]
    decode = [(b, c, truth.decode_step_time(b, c) * noise()) for b in (1, 2, 4, 8, 16, 32, 64)
              for c in (0, 256, 1024, 4096, 16384)]
    fitted = compute_profile_from_samples(prefill, decode)
    for name, want in vars(truth).items():
        assert getattr(fitted, name) == pytest.approx(want, rel=0.05), name
    assert fit_prefill(prefill) == (fitted.prefill_fixed_s, fitted.prefill_s_per_token, fitted.prefill_s_per_token_ctx)
    assert fit_decode(decode) == (fitted.decode_fixed_s, fitted.decode_s_per_seq, fitted.decode_s_per_seq_ctx)
    assert fit_quality(fitted, prefill, decode) < 0.01
    link = fit_link([(n, (20e-6 + n / 5e9) * noise()) for n in (2**k for k in range(10, 28))])
    assert link.bandwidth_bytes_per_s == pytest.approx(5e9, rel=0.03)
    assert link.latency_s == pytest.approx(20e-6, rel=0.05)


def test_fits_stay_non_negative_and_need_samples():
    samples = [(n, 0, 1e-3 * n) for n in (1, 2, 4, 8, 16)]  # purely linear: no fixed or attention term
    fixed, per_token, per_ctx = fit_prefill(samples)
    assert fixed >= 0 and per_ctx >= 0 and per_token == pytest.approx(1e-3, rel=1e-6)
    with pytest.raises(CostModelError, match="at least 3"):
        fit_decode([(1, 0, 1e-3)])



def test_member_cost_is_what_a_pack_measures_beyond_its_members_tokens():
    from dataclasses import replace

    def pack_seconds(truth, n, tokens=4, context=512):  # n prefills sharing one fixed term, plus n - 1 members
        return n * truth.prefill_time(tokens, context) - (n - 1) * truth.prefill_fixed_s + (n - 1) * truth.prefill_s_per_member

    truth = replace(REALISTIC, prefill_s_per_member=2.5e-3)
    samples = [(n, 4, 512, pack_seconds(truth, n)) for n in (1, 16)]
    assert with_member_cost(REALISTIC, samples).prefill_s_per_member == pytest.approx(2.5e-3)
    faster = [(n, 4, 512, 0.5 * pack_seconds(REALISTIC, n)) for n in (1, 16)]  # packs beat the model: no negative cost
    assert with_member_cost(REALISTIC, faster).prefill_s_per_member == 0.0
    assert with_member_cost(REALISTIC, []) == REALISTIC  # vLLM replicas give no samples


def test_simulated_pack_charges_each_extra_member():
    from dataclasses import replace

    from aaflow.runtime.calls import PrefillRequest
    from aaflow.runtime.sim_replica import SimReplica

    def pack_time(compute, n):
        sim = SimReplica("r", compute, 1000, 16, overhead_s=1e-3)
        for i in range(n):
            sim.session_open(f"s{i}", None)[2]()
        return sim.prefill_many([PrefillRequest(f"s{i}", [10 * i + j for j in range(4)]) for i in range(n)], lambda: 0)[0]

    costly = replace(REALISTIC, prefill_s_per_member=3e-3)
    assert pack_time(costly, 1) == pytest.approx(pack_time(REALISTIC, 1))
    assert pack_time(costly, 10) - pack_time(REALISTIC, 10) == pytest.approx(9 * 3e-3)


# --- hardware profiles -------------------------------------------------------------------
def test_shipped_profiles_load_as_projections():
    assert {"a100-80gb", "h100", "h200"} <= set(available_hardware())
    assert (hardware_dir() / "a100-80gb.yaml").is_file()
    for name in ("a100-80gb", "h100", "h200"):
        hw = load_hardware(name)
        assert hw.measured is False and hw.source.strip(), name
        assert {"nvlink", "pcie", "ib-200g", "ib-400g", "eth-25g", "eth-100g"} <= set(hw.links), name
        assert hw.link("ib-200g").bandwidth_bytes_per_s == pytest.approx(gbps(200))
        assert hw.memcpy_bytes_per_s == pytest.approx(hw.memory_bytes_per_s / 2)
    with pytest.raises(CostModelError, match="a100-80gb"):
        load_hardware("tpu-v9")


def test_yaml_round_trip_and_unknown_keys(tmp_path):
    hw = replace(load_hardware("a100-80gb").with_link("ray", LinkProfile(5e9, 1e-4)), call_overhead_s=2e-3)
    path = tmp_path / "hw.yaml"
    hw.save(path)
    assert HardwareProfile.load(path) == hw
    assert load_hardware(str(path)) == hw
    bad = hw.to_dict()
    bad["bogus_key"] = 1
    with pytest.raises(CostModelError, match="bogus_key"):
        HardwareProfile.from_dict(bad)
    bad = hw.to_dict()
    bad["links"]["ray"]["speed"] = 3
    with pytest.raises(CostModelError, match="speed"):
        HardwareProfile.from_dict(bad)
    units = dict(hw.to_dict(), memcpy_bytes_per_s="20 GB/s", links={"x": {"bandwidth_bytes_per_s": "25Gbps",
                                                                           "latency_s": "10us"}})
    parsed = HardwareProfile.from_dict(units)
    assert parsed.memcpy_bytes_per_s == 2e10 and parsed.links["x"] == LinkProfile(3.125e9, 1e-5)


def test_link_strings_and_compute_for():
    hw = load_hardware("h100")
    assert hw.link("25Gbps") == LinkProfile(3.125e9, 0.0)
    assert hw.link("25Gbps,10us") == LinkProfile(3.125e9, 1e-5)
    with pytest.raises(CostModelError, match="nvlink"):
        hw.link("warp-drive")
    assert LinkProfile(math.inf, 1e-3).transfer_time(10**9) == 1e-3  # a link that costs only its latency
    llama = model_profile("llama-3-8b")
    derived = hw.compute_for(llama)
    assert derived.prefill_s_per_token == pytest.approx(llama.flops_per_token / (989e12 * 0.5))
    assert derived.decode_fixed_s == pytest.approx(llama.weight_bytes / 3.35e12)
    assert derived.decode_s_per_seq_ctx == pytest.approx(131072 / 3.35e12)
    a100 = load_hardware("a100-80gb")
    assert a100.compute_for(KNOWN_MODELS["qwen3-8b"]) is a100.compute["qwen3-8b"]
    bare = HardwareProfile("cpu", True, "test", memcpy_bytes_per_s=2e10)
    with pytest.raises(CostModelError, match="aaflow calibrate"):
        bare.compute_for(llama)


def test_costmodel_imports_no_ray_or_torch():
    code = ("import sys; import costmodel.units, costmodel.model_profile, costmodel.hardware, costmodel.edge, "
            "costmodel.whatif, costmodel.calibration; "
            "print(sorted(m for m in ('ray', 'torch', 'transformers') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]", out


def test_scaled_compute_scales_every_term_and_rejects_bad_factors():
    from costmodel.hardware import ComputeProfile, HardwareProfile

    c = ComputeProfile(0.1, 1e-3, 1e-6, 0.05, 1e-3, 1e-5)
    twice = c.scaled(2.0)
    assert twice.prefill_time(300, 100) == pytest.approx(2 * c.prefill_time(300, 100))
    assert twice.decode_step_time(4, 1000) == pytest.approx(2 * c.decode_step_time(4, 1000))
    for bad in (0.0, -1.0, float("inf"), float("nan")):
        with pytest.raises(CostModelError, match="factor"):
            c.scaled(bad)
    hw = HardwareProfile(name="t", measured=True, source="test", memcpy_bytes_per_s=1e9, compute={"a": c, "b": c})
    slow = hw.with_compute_scaled({"a": 1.5})
    assert slow.compute["a"].decode_fixed_s == pytest.approx(0.075) and slow.compute["b"] == c
    split = hw.with_compute_scaled({"a": 1.5}, decode_factors={"a": 0.5}).compute["a"]
    assert split.prefill_time(300, 100) == pytest.approx(1.5 * c.prefill_time(300, 100))
    assert split.decode_step_time(4, 1000) == pytest.approx(0.5 * c.decode_step_time(4, 1000))
    with pytest.raises(CostModelError, match="decode_factor"):
        c.scaled(1.0, 0.0)


def test_contention_estimate_uses_both_solo_timings_and_reports_drift():
    from aaflow.calibration_cores import slowdown_estimate

    estimate, drift = slowdown_estimate(before=[1.0, 2.0], together=[1.2, 2.4], after=[1.0, 2.0])
    assert estimate == pytest.approx(1.2) and drift == 0
    # the machine slowed down mid-measurement: solo = mean of both, drift = the larger relative change
    estimate, drift = slowdown_estimate(before=[1.0, 1.0], together=[1.5, 1.5], after=[1.5, 1.2])
    assert estimate == pytest.approx((1.5 / 1.25 + 1.5 / 1.1) / 2) and drift == pytest.approx(0.5)
