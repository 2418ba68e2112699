"""`aaflow bench regression`: this code against an older revision on one workflow, side by side.

Each revision runs from its own git worktree, with its own kernel cache and its own local Ray
cluster; both clusters stay up and their runs are interleaved (old then new, new then old, ...), each
starting on idle cores, so that drift of a shared machine falls on both sides alike (blocks of runs
one side after the other differed by up to 8% on the same code). The workflow is written once as YAML
and read by both sides, so both run the same prompts. Reports each side's samples and medians,
new/old per strategy (ratio of medians, and the median of the paired ratios) against `--tolerance`
(5%: the no-regression target), the engine tokens each side computed and whether both produced the
same tokens.

    aaflow bench regression --against b4ecaa7 --pairs 64 --repeats 10

Default workflow: `aaflow bench workflows`' A->B pairs (`--pairs`, its defaults: a 2,000-token
system prompt, A generating 64 tokens); `--workflow FILE.yaml` times another.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from aaflow.workflow_files import load_workflow, save_workflow
from aaflow.benchmarks.common import add_dtype_argument, log, machine_facts, wait_until_quiet, write_json
from aaflow.benchmarks.ray_head import REPO
from aaflow.benchmarks.regression_side import PREFIX
from aaflow.benchmarks.scaling_bench import context_text
from aaflow.benchmarks.workflow_shapes import pair_workflow

SIDE_RUNNER = Path(__file__).with_name("regression_side.py")
SIDES = ("old", "new")


def run_order(repeat: int) -> tuple[str, str]:
    """Which side runs first in repeat `repeat`: old first in even repeats, new first in odd ones."""
    return SIDES if repeat % 2 == 0 else SIDES[::-1]


def resolve_revision(rev: str) -> str:
    """The commit id of `rev` in this checkout; a clear error when it is not one."""
    found = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--verify", "--quiet", f"{rev}^{{commit}}"],
                           capture_output=True, text=True)
    if found.returncode != 0:
        raise SystemExit(f"aaflow bench regression: {rev!r} is not a commit of {REPO} (a git checkout is needed; "
                         f"give a commit id, tag or branch)")
    return found.stdout.strip()


def summarize(samples: dict[str, dict[str, list[dict]]], strategies: list[str], tolerance: float) -> dict:
    """Per strategy: both sides' wall samples (in run order, repeat i of each side paired) and
    medians, new/old as the ratio of medians (the verdict, within `tolerance` or not) and as the
    median of the paired ratios, the engine tokens each computed (median) and whether every run of
    both sides gave the same tokens."""
    out = {}
    for s in strategies:
        walls = {side: [r["wall_s"] for r in samples[side][s]] for side in SIDES}
        medians = {side: statistics.median(w) for side, w in walls.items()}
        ratio = medians["new"] / medians["old"]
        digests = {r["tokens_digest"] for side in SIDES for r in samples[side][s]}
        out[s] = {"old_samples_s": walls["old"], "new_samples_s": walls["new"], "old_median_s": medians["old"],
                  "new_median_s": medians["new"], "ratio": ratio, "within_tolerance": ratio <= 1 + tolerance,
                  "paired_ratio_median": statistics.median(n / o for o, n in zip(walls["old"], walls["new"])),
                  "engine_tokens_computed": {side: statistics.median(r["engine_tokens_computed"]
                                                                     for r in samples[side][s]) for side in SIDES},
                  "plans": {side: sorted({p for r in samples[side][s] for p in r["plan"]}) for side in SIDES},
                  "same_tokens": len(digests) == 1}
    return out


class Side:
    """One revision's `regression_side.py` process: its cluster stays up between runs."""

    def __init__(self, name: str, checkout: Path, work: Path, spec: dict):
        spec_path = work / f"spec_{name}.json"
        spec_path.write_text(json.dumps({**spec, "side": name, "checkout": str(checkout)}))
        (work / f"tmp_{name}").mkdir()
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(checkout), os.environ.get("PYTHONPATH"))
                                                           if p),
               "TORCH_EXTENSIONS_DIR": str(work / f"kernels_{name}"),
               "TMPDIR": str(work / f"tmp_{name}")}  # its own Ray session folder: its own local cluster
        env.pop("RAY_ADDRESS", None)  # never a cluster of the caller's: the two sides would share it
        self.name = name
        self.proc = subprocess.Popen([sys.executable, str(SIDE_RUNNER), str(spec_path)], cwd=checkout, env=env,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1)
        self.answer()  # "ready": started and warmed up

    def answer(self) -> dict:
        for line in self.proc.stdout:
            if line.startswith(PREFIX):
                return json.loads(line[len(PREFIX):])
            sys.stderr.write(line)
        raise SystemExit(f"aaflow bench regression: the {self.name} side exited (code {self.proc.wait()})")

    def run(self, strategy: str) -> dict:
        self.proc.stdin.write(strategy + "\n")
        self.proc.stdin.flush()
        return self.answer()

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.stdin.write("quit\n")
                self.proc.stdin.flush()
                self.proc.wait(timeout=120)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()


def run(args) -> dict:
    commits = {"new": resolve_revision(args.new), "old": resolve_revision(args.against)}
    wf = (load_workflow(args.workflow) if args.workflow else
          pair_workflow(args.pairs, context_text(args.prefix_tokens, 113), args.a_tokens))
    models = {a.model for a in wf.agents()}
    if len(models) != 1:
        raise SystemExit(f"aaflow bench regression: the workflow uses {sorted(models)}; one model is supported")
    samples = {side: {s: [] for s in args.strategies} for side in SIDES}
    work = Path(tempfile.mkdtemp(prefix="aar-"))  # short: Ray's socket paths under it are limited to 107 bytes
    spec = {"workflow": str(save_workflow(wf, work / "workflow.yaml")), "model": models.pop(),
            "replicas": args.replicas, "dtype": args.dtype, "chunk_tokens": args.chunk_tokens,
            "strategies": args.strategies}
    checkouts = {side: work / side for side in SIDES}
    sides: dict[str, Side] = {}
    try:
        for side in SIDES:
            subprocess.run(["git", "-C", str(REPO), "worktree", "add", "--detach", "--quiet", str(checkouts[side]),
                            commits[side]], check=True)
            log(f"regression: starting the {side} side ({commits[side][:9]}) and its untimed runs ...")
            sides[side] = Side(side, checkouts[side], work, spec)
        for r in range(args.repeats):
            turn = r % len(args.strategies)
            for s in args.strategies[turn:] + args.strategies[:turn]:
                for side in run_order(r):
                    wait_until_quiet()
                    samples[side][s].append({**sides[side].run(s), "repeat": r})
                log(f"regression: repeat {r + 1}/{args.repeats} {s}: old {samples['old'][s][-1]['wall_s']:.2f} s, "
                    f"new {samples['new'][s][-1]['wall_s']:.2f} s")
    finally:
        for side in sides.values():
            side.close()
        for checkout in checkouts.values():
            subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(checkout)],
                           capture_output=True)
        shutil.rmtree(work, ignore_errors=True)
    rows = summarize(samples, args.strategies, args.tolerance)
    for s, row in rows.items():
        log(f"regression {wf.name} {s}: old {row['old_median_s']:.2f} s, new {row['new_median_s']:.2f} s, new/old "
            f"{row['ratio']:.3f} ({'within' if row['within_tolerance'] else 'OVER'} {args.tolerance:.0%}; paired "
            f"{row['paired_ratio_median']:.3f}); "
            f"same tokens: {row['same_tokens']}")
    report = {"benchmark": "regression", "machine": machine_facts(), "workflow": wf.name,
              "old_code": commits["old"], "new_code": commits["new"],
              "order": "interleaved: each repeat runs each strategy on both sides back to back, old first in even ones",
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
    p.add_argument("--repeats", type=int, default=10, help="timed runs of each strategy on each side")
    p.add_argument("--tolerance", type=float, default=0.05, help="new/old above 1 + this is a regression")
    p.add_argument("--chunk-tokens", type=int, default=16)
    add_dtype_argument(p)
    p.add_argument("--out", default="results/regression.json")
