"""`aaflow bench overlap-bound`'s schedules and bounds: streaming B's prompt into A's decode steps
must give text's tokens, and the bounds must add up the measured phases as documented."""

from __future__ import annotations

import pytest

from aaflow.benchmarks.overlap_bound import a_b_schedules, a_b_x1_bounds


def test_streamed_schedule_gives_text_tokens(make_engine, tiny_llama_dir):
    engine = make_engine(tiny_llama_dir, num_blocks=64)
    system = [(7 * i) % 200 + 3 for i in range(90)]
    times, tokens = a_b_schedules(engine, [5, 6, 7, 8], system, [9, 10, 11], a_tokens=6)
    assert tokens["stream"] == tokens["text"]
    assert len(tokens["text"][0]) == 6
    assert times["stream"]["b_tokens_after_a"] < times["text"]["b_tokens_after_a"] == 90 + 6 + 3
    assert engine.stats().used == 0


def test_bounds_add_the_measured_phases():
    text = {"a_steps_s": 1.0, "b_after_a_s": 0.5, "b_tokens_after_a": 100}
    linear = {1: 0.010, 1 + 10: 0.010 + 10 * 0.001, 100: 0.1}  # a riding row 1 ms; one-pass rows 1 ms
    bounds = a_b_x1_bounds(text, {"b_after_a_s": 0.02}, one_thread_steps_s=1.5, linear=linear, chunk=10)
    assert bounds["linear_ms_per_row_riding_a_step"] == pytest.approx(1.0)
    assert bounds["linear_ms_per_row_in_one_pass"] == pytest.approx(1.0)
    assert bounds["one_replica_shared_weight_reads"] == pytest.approx(1.0 + 0.1 + 0.4 + 0.02)
    assert bounds["one_replica_only_linear_rows_cost"] == pytest.approx(1.0 + 0.1 + 0.02)
    assert bounds["two_replicas"] == pytest.approx(1.52)
    assert bounds["absolute"] == pytest.approx(1.02)
