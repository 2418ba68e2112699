"""The analytical cost model's timing formulas: compute closed forms against loops, hand-computed
edge predictions, break-even what-ifs, and the calibration fits that recover a profile's coefficients
from measured samples.

Pure and fast: no Ray, no model weights. Units, model profiles and hardware profiles:
test_costmodel_profiles.py.
"""

from __future__ import annotations

import math
import random
import subprocess
import sys

import numpy as np
import pytest

from aaflow.common.errors import CostModelError
from aaflow.costmodel.fitting import (compute_profile_from_samples, fit_decode, fit_link, fit_prefill, fit_quality,
                                  with_member_cost)
from aaflow.costmodel.edge import EdgeCase, predict_edge
from aaflow.costmodel.hardware import ComputeProfile, LinkProfile, load_hardware
from aaflow.costmodel.model_profile import KNOWN_MODELS, model_profile
from aaflow.costmodel.whatif import (break_even_bandwidth, break_even_bandwidth_flops, break_even_context,
                              transfer_speedup)

# simple numbers for hand-computed timelines: prefill 1 s + 0.1 s/token, decode 0.5 s/step
SIMPLE = ComputeProfile(1.0, 0.1, 0.0, 0.5, 0.0, 0.0)
REALISTIC = ComputeProfile(2e-3, 1.2645e-4, 4.726e-9, 8.5e-3, 1.2592e-4, 7.232e-8)  # the A100 qwen3-8b entry


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


def test_contention_estimate_uses_both_solo_timings_and_reports_drift():
    from aaflow.cluster.calibration_cores import slowdown_estimate

    estimate, drift = slowdown_estimate(before=[1.0, 2.0], together=[1.2, 2.4], after=[1.0, 2.0])
    assert estimate == pytest.approx(1.2) and drift == 0
    # the machine slowed down mid-measurement: solo = mean of both, drift = the larger relative change
    estimate, drift = slowdown_estimate(before=[1.0, 1.0], together=[1.5, 1.5], after=[1.5, 1.2])
    assert estimate == pytest.approx((1.5 / 1.25 + 1.5 / 1.1) / 2) and drift == pytest.approx(0.5)


# --- the package -----------------------------------------------------------------------
def test_costmodel_imports_no_ray_or_torch():
    code = ("import sys; import aaflow.costmodel.units, aaflow.costmodel.model_profile, aaflow.costmodel.hardware, aaflow.costmodel.edge, "
            "aaflow.costmodel.whatif, aaflow.costmodel.fitting; "
            "print(sorted(m for m in ('ray', 'torch', 'transformers') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]", out


def test_simulated_fork_of_a_ref_reuses_what_an_earlier_fork_computed():
    """As the engine's `PrefixReuse`: the second fork continuing a document with the same words pays
    only for the words past the last whole block an earlier fork cached."""
    from aaflow.runtime.calls import PrefillRequest
    from aaflow.runtime.sim_replica import SimReplica

    sim = SimReplica("r", REALISTIC, 1000, 16, overhead_s=1e-3)
    doc, words = list(range(1000, 1070)), list(range(2000, 2040))  # 70 tokens, then 40: 110 in all
    sim.materialize(doc, "doc")[2]()
    answers = []
    for sid in ("first", "second"):
        sim.session_open(sid, "doc")[2]()
        _, out, apply = sim.prefill_many([PrefillRequest(sid, words)], lambda: 0)
        apply()
        answers.append(out[0])
    assert [a.computed for a in answers] == [40, 110 - 96]  # 96: six whole blocks of 16 cached
    sim.steps(["second"], 1, [(1, ())], lambda: 0)[2]()  # decoded: its later segments are not looked up
    _, out, _ = sim.prefill_many([PrefillRequest("second", [7, 7, 7])], lambda: 0)
    assert out[0].computed == 3
