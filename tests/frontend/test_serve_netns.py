"""`aaflow bench serve --hosts netns`'s verdicts: `auto` against the better of always-move and
always-compute, and against vLLM behind its router; and the options that ask for it."""

from __future__ import annotations

import argparse

import pytest

from aaflow.benchmarks.serve_bench import add_arguments
from aaflow.benchmarks.serve_netns import verdicts


def _side(wall: float, p99: float) -> dict:
    return {"wall_s": wall, "latency_p50_s": wall / 2, "latency_p99_s": p99}


def test_auto_is_judged_against_the_better_fixed_choice_and_against_vllm():
    sides = {"aaflow:auto": _side(20.0, 19.0), "aaflow:move": _side(21.0, 20.0), "aaflow:compute": _side(25.0, 24.0),
             "vllm-graph-b32@round_robin": _side(26.0, 25.0)}
    out = verdicts(sides, {"vllm-graph-b32@round_robin": 26.0})
    assert out["auto_vs_best_fixed"] == pytest.approx(21.0 / 20.0)  # move was the better fixed choice
    assert out["vllm_side"] == "vllm-graph-b32@round_robin"
    assert out["throughput_ratio"] == pytest.approx(26.0 / 20.0)
    assert out["latency_p99_s_ratio"] == pytest.approx(19.0 / 25.0)
    slower = verdicts({**sides, "aaflow:auto": _side(30.0, 29.0)}, None)
    assert slower["auto_vs_best_fixed"] < 1 and slower["throughput_ratio"] < 1


def test_without_vllm_only_the_fixed_choices_are_compared():
    out = verdicts({"aaflow:auto": _side(10.0, 9.0), "aaflow:move": _side(12.0, 11.0),
                    "aaflow:compute": _side(9.0, 8.0)}, None)
    assert out["auto_vs_best_fixed"] == pytest.approx(0.9) and "throughput_ratio" not in out


def test_the_netns_options_default_to_three_link_rates_on_local_hosts():
    p = argparse.ArgumentParser()
    add_arguments(p)
    assert p.parse_args([]).hosts == "local"
    args = p.parse_args(["--replicas", "2", "--hosts", "netns", "--link-rates", "1000", "100"])
    assert args.hosts == "netns" and args.link_rates == [1000.0, 100.0]
    assert p.parse_args(["--hosts", "netns"]).link_rates == [10000, 1000, 100]
