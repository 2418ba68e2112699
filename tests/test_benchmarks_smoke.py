"""Benchmarks are timing jobs, not tests: here only that each module imports, its parser builds, and
the shared plotting helper writes a PNG. Nothing is run or timed."""

from __future__ import annotations

import argparse
import importlib

import pytest

from aaflow.cli import BENCHMARKS, build_parser

QUICK = ["scaling", "overhead", "consistency", "workflows"]


@pytest.mark.parametrize("name", sorted(BENCHMARKS))
def test_benchmark_module_imports_and_parser_builds(name):
    module = importlib.import_module(BENCHMARKS[name])
    assert callable(module.run)
    parser = argparse.ArgumentParser()
    module.add_arguments(parser)
    args = parser.parse_args(["--quick"] if name in QUICK else [])
    if name in QUICK:
        assert args.quick and args.out == f"results/{name}.json"


@pytest.mark.parametrize("name", QUICK)
def test_new_benchmarks_are_registered_with_quick(name):
    assert name in BENCHMARKS
    args = build_parser().parse_args(["bench", name, "--quick"])
    assert args.quick and args.name == name


def test_bench_all_accepts_quick():
    args = build_parser().parse_args(["bench", "all", "--quick"])
    assert args.name == "all" and args.quick


def test_plots_write_png(tmp_path):
    from benchmarks.plots import write_plot

    out = write_plot(tmp_path / "tiny.json", [
        {"title": "lines", "xlabel": "agents", "series": {"text": {1: 10, 4: 40}, "auto": {1: 10, 4: 12}},
         "logx": True, "hlines": {"paper": 20}},
        {"title": "bars", "series": {"text": {"chain": 3.0, "fan-out": None}, "auto": {"chain": 2.0}}},
    ])
    assert out == tmp_path / "tiny.png"
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
