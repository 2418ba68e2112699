"""`aaflow bench regression`: this code against an older revision on one workflow, side by side.

Each revision is checked out in its own git worktree with its own kernel cache; blocks of timed runs
alternate new, old, old, new, ... (each block a fresh cluster, its strategies taking turns within
it), so drift of a shared machine falls on both sides alike. The workflow is written once as YAML
and read by both sides, so both run the same prompts. Reports each side's samples and medians,
new/old per strategy against `--tolerance` (5%: the no-regression target), the engine tokens
each side computed and whether both produced the same tokens.

    aaflow bench regression --against b4ecaa7 --pairs 64 --repeats 5 --blocks 4

Default workflow: `aaflow bench workflows`' A->B pairs (`--pairs`, its defaults: a 2,000-token
system prompt, A generating 64 tokens); `--workflow FILE.yaml` times another.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from aaflow.workflow.yaml_io import load_workflow, save_workflow
from benchmarks.common import add_dtype_argument, log, machine_facts, write_json
from benchmarks.ray_head import REPO
from benchmarks.scaling_bench import context_text
from benchmarks.workflow_shapes import pair_workflow

SIDE_RUNNER = Path(__file__).with_name("regression_side.py")
ABBA = ("new", "old", "old", "new")


def block_sides(blocks: int) -> list[str]:
    """The side of each block: new, old, old, new, repeated (each side first and last equally often)."""
    return [ABBA[i % len(ABBA)] for i in range(blocks)]


def resolve_revision(rev: str) -> str:
    """The commit id of `rev` in this checkout; a clear error when it is not one."""
    found = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--verify", "--quiet", f"{rev}^{{commit}}"],
                           capture_output=True, text=True)
    if found.returncode != 0:
        raise SystemExit(f"aaflow bench regression: {rev!r} is not a commit of {REPO} (a git checkout is needed; "
                         f"give a commit id, tag or branch)")
    return found.stdout.strip()


def summarize(samples: dict[str, dict[str, list[dict]]], strategies: list[str], tolerance: float) -> dict:
    """Per strategy: both sides' wall samples and medians, new/old, within tolerance or not, the
    engine tokens each computed (median) and whether every run of both sides gave the same tokens."""
    out = {}
    for s in strategies:
        walls = {side: [r["wall_s"] for r in samples[side][s]] for side in ("old", "new")}
        medians = {side: statistics.median(w) for side, w in walls.items()}
        ratio = medians["new"] / medians["old"]
        digests = {r["tokens_digest"] for side in ("old", "new") for r in samples[side][s]}
        out[s] = {"old_samples_s": walls["old"], "new_samples_s": walls["new"], "old_median_s": medians["old"],
                  "new_median_s": medians["new"], "ratio": ratio, "within_tolerance": ratio <= 1 + tolerance,
                  "engine_tokens_computed": {side: statistics.median(r["engine_tokens_computed"]
                                                                     for r in samples[side][s])
                                             for side in ("old", "new")},
                  "plans": {side: sorted({p for r in samples[side][s] for p in r["plan"]}) for side in ("old", "new")},
                  "same_tokens": len(digests) == 1}
    return out


def _run_block(side: str, checkout: Path, kernels: Path, spec: dict, work: Path, block: int) -> list[dict]:
    spec_path, out_path = work / f"spec_{block}.json", work / f"block_{block}_{side}.json"
    spec_path.write_text(json.dumps({**spec, "side": side, "checkout": str(checkout)}))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(checkout), os.environ.get("PYTHONPATH", "")]).rstrip(
        os.pathsep), "TORCH_EXTENSIONS_DIR": str(kernels)}
    done = subprocess.run([sys.executable, str(SIDE_RUNNER), str(spec_path), str(out_path)], cwd=checkout, env=env)
    if done.returncode != 0:
        raise SystemExit(f"aaflow bench regression: block {block} ({side}) failed with exit {done.returncode}")
    return json.loads(out_path.read_text())["rows"]


def run(args) -> dict:
    commits = {"new": resolve_revision(args.new), "old": resolve_revision(args.against)}
    wf = (load_workflow(args.workflow) if args.workflow else
          pair_workflow(args.pairs, context_text(args.prefix_tokens, 113), args.a_tokens))
    models = {a.model for a in wf.agents()}
    if len(models) != 1:
        raise SystemExit(f"aaflow bench regression: the workflow uses {sorted(models)}; one model is supported")
    samples = {side: {s: [] for s in args.strategies} for side in ("old", "new")}
    with tempfile.TemporaryDirectory(prefix="aaflow-regression-") as tmp:
        work = Path(tmp)
        spec = {"workflow": str(save_workflow(wf, work / "workflow.yaml")), "model": models.pop(),
                "replicas": args.replicas, "dtype": args.dtype, "chunk_tokens": args.chunk_tokens,
                "strategies": args.strategies, "repeats": args.repeats}
        checkouts = {side: work / side for side in commits}
        try:
            for side, commit in commits.items():
                subprocess.run(["git", "-C", str(REPO), "worktree", "add", "--detach", "--quiet", str(checkouts[side]),
                               commit], check=True)
            for block, side in enumerate(block_sides(args.blocks)):
                log(f"regression: block {block + 1}/{args.blocks}: {side} ({commits[side][:9]})")
                for row in _run_block(side, checkouts[side], work / f"kernels_{side}", spec, work, block):
                    samples[side][row["strategy"]].append({**row, "block": block})
        finally:
            for checkout in checkouts.values():
                subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(checkout)],
                               capture_output=True)
    rows = summarize(samples, args.strategies, args.tolerance)
    for s, row in rows.items():
        log(f"regression {wf.name} {s}: old {row['old_median_s']:.2f} s, new {row['new_median_s']:.2f} s, new/old "
            f"{row['ratio']:.3f} ({'within' if row['within_tolerance'] else 'OVER'} {args.tolerance:.0%}); "
            f"same tokens: {row['same_tokens']}")
    report = {"benchmark": "regression", "machine": machine_facts(), "workflow": wf.name,
              "old_code": commits["old"], "new_code": commits["new"], "order": block_sides(args.blocks),
              "settings": {k: v for k, v in vars(args).items() if k not in ("func", "out")}, "rows": rows,
              "samples": samples}
    write_json(args.out, report)
    return report


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--against", required=True, metavar="REV", help="the older revision (commit id, tag or branch)")
    p.add_argument("--new", default="HEAD", metavar="REV",
                   help="the newer revision (default HEAD: committed code; uncommitted changes are not measured)")
    p.add_argument("--workflow", default=None, help="a workflow YAML (default: the A->B pairs of `bench workflows`)")
    p.add_argument("--pairs", type=int, default=64)
    p.add_argument("--prefix-tokens", type=int, default=2000, help="the pairs' shared system prompt")
    p.add_argument("--a-tokens", type=int, default=64, help="tokens each A generates")
    p.add_argument("--strategies", nargs="+", default=["text", "auto"])
    p.add_argument("--replicas", type=int, default=1)
    p.add_argument("--repeats", type=int, default=5, help="timed runs of each strategy per block")
    p.add_argument("--blocks", type=int, default=4, help="blocks, in the order new, old, old, new, ...")
    p.add_argument("--tolerance", type=float, default=0.05, help="new/old above 1 + this is a regression")
    p.add_argument("--chunk-tokens", type=int, default=16)
    add_dtype_argument(p)
    p.add_argument("--out", default="results/regression.json")
