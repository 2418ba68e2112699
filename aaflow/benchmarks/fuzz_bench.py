"""`aaflow bench fuzz`: property-based fuzzing of every input surface, >= 1,000 cases each.

Surfaces (see `aaflow.benchmarks.fuzz`): DSL workflow graphs, mutated workflow YAML files, operator
arguments, KV import payloads and received descriptors, on tiny random-weight models in this
process; and random small workflows run on a 2-replica local Ray cluster of the tiny model.
Reports, per surface, the cases run, outcomes (ok / typed error by class), untyped errors, hangs (cases past their time bound) and invariant violations (leaked blocks, sequences or refs),
with the first failures verbatim. The target is 0 untyped errors, 0 hangs and 0 violations.
"""

from __future__ import annotations

import argparse
import random
import shutil
import tempfile
from pathlib import Path

import torch

from aaflow.benchmarks.common import log, machine_facts, write_json


def run(args) -> dict:
    from aaflow.benchmarks.fuzz import RAY_SURFACE_NAMES, SURFACE_NAMES, make_models, make_surface, run_surface

    torch.set_num_threads(args.threads)
    if args.quick:
        args.cases = min(args.cases, 100)
    seed = args.seed if args.seed is not None else random.randrange(2**32)
    surfaces = args.surface or list(SURFACE_NAMES + RAY_SURFACE_NAMES)
    folder = Path(tempfile.mkdtemp(prefix="aaflow-fuzz-models-"))
    results = {}
    try:
        models = make_models(folder)
        for name in surfaces:
            with make_surface(name, *models) as surface:
                report = run_surface(surface, args.cases, seed=seed)
            results[name] = report.as_dict()
            log(f"{name}: {report.cases} cases in {report.seconds:.0f} s: {report.ok} ok, "
                f"{sum(report.typed.values())} typed errors, {report.untyped} untyped, {report.hangs} hangs, "
                f"{report.invariant_violations} invariant violations")
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    totals = {k: sum(r[k] for r in results.values())
              for k in ("cases", "untyped_errors", "hangs", "invariant_violations")}
    report = {"benchmark": "fuzz", "machine": machine_facts(), "seed": seed,
              "settings": {"cases_per_surface": args.cases, "surfaces": surfaces, "threads": args.threads},
              "surfaces": results, "totals": totals}
    write_json(args.out, report)
    return report


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--cases", type=int, default=1000, help="Hypothesis examples per surface")
    p.add_argument("--surface", action="append", default=[],
                   choices=["workflow_graphs", "yaml_files", "operator_arguments", "kv_payloads", "workflow_runs"],
                   help="only this surface (repeatable; default: all)")
    p.add_argument("--seed", type=int, default=None, help="Hypothesis seed (default: random, recorded)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--quick", action="store_true", help="100 cases per surface")
    p.add_argument("--out", default="results/fuzz.json")
