"""`aaflow bench planner`: the cost model against measurement, and the planner's choices.

Grid: shared context length C x upstream output length O x link (the real transports and
emulated `ray@<bandwidth>` links). Each cell is an A -> B workflow on a two-replica SmolLM2
cluster: A reads the context and writes O tokens; B reads the context and A's output and writes
8. Every strategy is run (text, recompute, stream, transfer, transfer+stream, and auto = the
planner's choice) from cold prefix caches and its wall time compared with the simulator's
prediction, made from a profile calibrated in the same run. Reported: median and worst
|predicted - measured| / measured, and how often the planner's choice is within 10% of the
measured best and not worse than text (`judge_choice`). The transfer-vs-recompute crossover is its own benchmark
(`aaflow bench crossover`). With `--downstream-model`, B runs another model on its own replica
(only tokens cross the edge, so one link is enough; `llama-360m-random` is a larger model with
random weights, timing only).
"""

from __future__ import annotations

import argparse
import statistics

from aaflow.benchmarks.common import log, machine_facts, write_json

LINK_FREE = ("text", "recompute", "stream")
LINKED = ("transfer", "transfer+stream", "auto")


def context_text(tokenizer, tokens: int) -> str:
    from aaflow.configs import CONFIG_DIR

    paper = (CONFIG_DIR / "workflows" / "paper.txt").read_text()
    ids = tokenizer.encode("\n\n".join([paper] * (tokens // 400 + 1)), add_special_tokens=False)[:tokens]
    return tokenizer.decode(ids)


def edge_workflow(context: str, upstream_tokens: int, downstream_model: str = "smollm2"):
    import aaflow as af

    wf = af.Workflow("edge")
    ctx = wf.context("ctx", context)
    a = wf.agent("A", "smollm2", [ctx, "Summarize the key point of this text."], max_tokens=upstream_tokens,
                 ignore_eos=True)
    wf.agent("B", downstream_model, [ctx, "A colleague wrote:", a, "Answer in one sentence: is it right?"], max_tokens=8,
             ignore_eos=True)
    return wf


class Predictor:
    """Simulated makespans from a calibrated profile, per strategy and link."""

    def __init__(self, cluster, infos: dict[str, dict], chunk_tokens: int) -> None:
        from aaflow.cluster.planning import model_profiles, replica_names

        self.chunk = chunk_tokens
        self.models = model_profiles(infos)
        self.replicas = replica_names(cluster)

    def __call__(self, profile, spec, strategy: str, link: str) -> float:
        from aaflow.cluster.planning import with_emulated_link
        from aaflow.planner.simulate import simulate
        from aaflow.costmodel.workflow_spec import ClusterSpec

        profile = with_emulated_link(profile, link)
        cspec = ClusterSpec(self.replicas, link=link, chunk_tokens=self.chunk)
        return simulate(spec, cspec, profile, self.models, {a.name: strategy for a in spec.agents},
                        call_overhead_s=profile.call_overhead_s).makespan_s


def _measure(af, ray, cluster, wf, runs: list[tuple[str, str, object]], chunk, repeats) -> dict[str, list[float]]:
    """Wall times per (strategy, link, plan) in `runs`, keyed by strategy. The runs are interleaved
    inside each repeat, forward in even repeats and backward in odd ones, so that over two repeats
    every strategy sits on average mid-way while the machine drifts."""
    samples: dict[str, list[float]] = {s: [] for s, _, _ in runs}
    for rep in range(repeats):
        for strategy, link, plan in (runs if rep % 2 == 0 else runs[::-1]):
            ray.get([r.actor.clear_prefix_cache.remote() for r in cluster.replicas()])
            res = af.run(wf, cluster, strategy=strategy, chunk_tokens=chunk, transport=link, plan=plan)
            samples[strategy].append(res.wall_s)
    return samples


def judge_choice(samples: dict[str, list[float]], decisions: dict[str, str]) -> dict:
    """How the planner did in one cell, from every strategy's wall times (`samples`, "auto" included):
    the choice is judged by `auto`'s own runs against the other strategies' own runs, as timed
    (`decisions`, the plan, is recorded beside it by the caller)."""
    auto = statistics.median(samples["auto"])
    own = {s: statistics.median(v) for s, v in samples.items() if s != "auto"}
    return {"choice_s": auto, "choice_within_10pct_of_best": auto <= 1.10 * min(own.values()),
            "choice_not_worse_than_text": auto <= own["text"]}


def run_grid(af, ray, cluster, calibrate_now, args) -> tuple[list[dict], list]:
    """Every cell of the grid; the profile is calibrated first, and again before each context length
    with `--recalibrate`; with `--track-drift` each cell's predictions use it scaled by the speed
    measured just before the cell (this shared machine's speed drifts). Returns (cells, profiles)."""
    from aaflow.costmodel.profile_store import model_key
    from aaflow.cluster.planning import plan_checked, replica_infos, workflow_spec
    from aaflow.runtime import prompt_builders

    builders, _, _ = prompt_builders({"smollm2", args.downstream_model})
    tokenizer = builders["smollm2"].tokenizer
    infos = replica_infos(cluster)
    keys = {model: model_key(info) for model, info in infos.items()}  # compute-entry key per model
    predict = Predictor(cluster, infos, args.chunk_tokens)
    cells, profiles, baseline = [], [], {}
    for tokens in args.contexts:
        if not profiles or args.recalibrate:
            profiles.append(calibrate_now())
            baseline = _probe(ray, cluster, keys) if args.track_drift else {}
        context = context_text(tokenizer, tokens)
        for out in args.outputs:
            wf = edge_workflow(context, out, args.downstream_model)
            spec = workflow_spec(wf, builders)
            drift = _drift(ray, cluster, baseline, keys) if args.track_drift else {}
            profile = profiles[-1].with_compute_scaled(drift["prefill"], drift["decode"]) if drift else profiles[-1]
            for link in args.links:
                plan = plan_checked(wf, cluster, builders, hardware=profile, transport=link,
                                    chunk_tokens=args.chunk_tokens, progress=None)
                runs = [(s, "ray", None) for s in LINK_FREE] + [(s, link, plan if s == "auto" else None) for s in LINKED]
                samples = _measure(af, ray, cluster, wf, runs, args.chunk_tokens, args.repeats)
                measured = {s: statistics.median(v) for s, v in samples.items()}
                predicted = {s: predict(profile, spec, s, link) for s in LINK_FREE + LINKED[:2]}
                predicted["auto"] = plan.predicted.makespan_s
                cell = {"context_tokens": tokens, "upstream_tokens": out, "link": link, "profile": len(profiles) - 1,
                        "drift": drift, "downstream_model": args.downstream_model, "samples_s": samples,
                        "measured_s": measured, "predicted_s": predicted, "plan": plan.decisions,
                        "errors": {s: abs(predicted[s] - measured[s]) / measured[s] for s in measured},
                        **judge_choice(samples, plan.decisions)}
                cells.append(cell)
                log(f"C={tokens} O={out} {link} B={args.downstream_model}: " + ", ".join(
                    f"{s} {measured[s]:.2f}/{predicted[s]:.2f}" for s in measured) + f" | plan {plan.decisions}")
    return cells, profiles


PROBE_PREFILL, PROBE_DECODE = ((512, 0),), ((1, 512),)  # a 512-token prefill; decode steps at 512 tokens


def _probe(ray, cluster, keys: dict[str, str]) -> dict[str, tuple[float, float]]:
    """Per compute entry (`keys`: model -> entry): (seconds of a 512-token prefill, median of 2;
    seconds of a decode step at 512 tokens, median of 16), timed inside the model's first replica
    (about 2 s)."""
    probes = {}
    for model, key in sorted(keys.items()):
        actor = cluster.replicas(model)[0].actor
        prefill = ray.get(actor.calibrate_prefill.remote(PROBE_PREFILL, 2))[0][2]
        decode = ray.get(actor.calibrate_decode.remote(PROBE_DECODE, 16))[0][2]
        probes[key] = (prefill, decode)
    return probes


def _drift(ray, cluster, baseline: dict, keys: dict[str, str]) -> dict[str, dict[str, float]]:
    """Per compute entry, how much slower (> 1) or faster each model's replica prefills and decodes
    now than just after the profile was calibrated: the same probes timed then (`baseline`) and now.
    Against the probes, not the profile's fit: the fit's own error is not drift. Prefill and decode
    drift apart on this shared machine (one cell: prefill x0.98, decode x0.78)."""
    now = _probe(ray, cluster, keys)
    factors = {part: {key: now[key][i] / baseline[key][i] for key in now} for i, part in enumerate(("prefill", "decode"))}
    log("speed now vs calibration: " + ", ".join(
        f"{key} prefill x{factors['prefill'][key]:.2f}, decode x{factors['decode'][key]:.2f}" for key in now))
    return factors


def summarize(cells: list[dict]) -> dict:
    """Prediction error over every (cell, strategy), and the planner's hit rates (`judge_choice`:
    `auto`'s own runs)."""
    errors = [(e, c["context_tokens"], c["upstream_tokens"], c["link"], s)
              for c in cells for s, e in c["errors"].items()]
    worst = max(errors)
    judged = [c for c in cells if "choice_s" in c]

    def rate(key: str, among: list[dict]):
        return sum(c[key] for c in among) / len(among) if among else None

    return {
        "cells": len(cells), "median_abs_rel_error": statistics.median(e for e, *_ in errors),
        "worst": {"error": worst[0], "context_tokens": worst[1], "upstream_tokens": worst[2], "link": worst[3],
                  "strategy": worst[4]},
        "choice_within_10pct_of_best": rate("choice_within_10pct_of_best", judged),
        "choice_not_worse_than_text": rate("choice_not_worse_than_text", judged),
        "targets": {"median_abs_rel_error": 0.15, "choice_within_10pct_of_best": 0.90, "crossover_error": 0.25},
    }


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--quick", action="store_true", help="2 contexts x 1 output, the ray link, one repeat")
    p.add_argument("--contexts", type=int, nargs="+", default=None)
    p.add_argument("--outputs", type=int, nargs="+", default=None)
    p.add_argument("--links", nargs="+", default=None)
    p.add_argument("--repeats", type=int, default=None, help="default 2 (quick: 1)")
    p.add_argument("--chunk-tokens", type=int, default=16)
    p.add_argument("--recalibrate", action="store_true",
                   help="calibrate again before each context length (a shared machine's speed drifts)")
    p.add_argument("--track-drift", action="store_true",
                   help="before each cell, time a 512-token prefill and decode steps at 512 tokens per model and scale the "
                        "profile's prefill and decode terms by how much slower or faster they run than at calibration")
    p.add_argument("--downstream-model", default="smollm2",
                   help="B's model; another one (e.g. llama-360m-random) gets its own replica: a different-model edge")
    p.add_argument("--combine", nargs="+", metavar="JSON", default=None,
                   help="measure nothing: summarize the grids of earlier runs together (written to --out)")
    p.add_argument("--out", default="results/planner.json")


def combine(paths: list[str], out: str) -> dict:
    """One summary over the cells of several `aaflow bench planner` runs (each keeps its own profile)."""
    import json

    runs = [json.loads(open(path).read()) for path in paths]
    cells = [cell for r in runs for cell in r["grid"]]
    report = {"benchmark": "planner", "combined_from": paths, "summary": summarize(cells), "grid": cells}
    log(f"planner summary over {len(paths)} runs: {report['summary']}")
    write_json(out, report)
    _plot(report, out.replace(".json", ".png"))
    return report


def run(args) -> dict:
    if args.combine:
        return combine(args.combine, args.out)
    import ray

    import aaflow as af
    from aaflow.cluster.calibration import calibrate

    args.contexts = args.contexts or ([256, 2048] if args.quick else [256, 1024, 2048, 4096, 8192])
    args.outputs = args.outputs or ([16] if args.quick else [16, 64, 256, 512])
    args.repeats = args.repeats or (1 if args.quick else 2)
    args.links = args.links or (["ray"] if args.quick else
                                ["ray", "nixl", "ray@100Mbps", "ray@1Gbps", "nixl@10Gbps", "nixl@25Gbps"])
    same_model = args.downstream_model == "smollm2"
    if not same_model:
        args.links = args.links[:1]  # no KV crosses a different-model edge: the link plays no part
    replicas = {"smollm2": 2} if same_model else {"smollm2": 1, args.downstream_model: 1}
    pool_tokens = max(6 * max(args.contexts), 8192)  # room for the grid and for calibration's points
    cluster = af.init(replicas=replicas, kv_cache_bytes=pool_tokens * 46080)  # up to 45 KiB of KV per token
    transports = tuple(dict.fromkeys(link.split("@")[0] for link in args.links))

    def calibrate_now():
        log("calibrating this machine in the same run (the cost model's input) ...")
        profile = calibrate(cluster, quick=True, transports=transports, progress=log)
        if not same_model:  # one replica per model: no link to measure, and none is used
            from aaflow.costmodel.hardware import LinkProfile

            profile = profile.with_link(args.links[0], LinkProfile(float("inf"), 0.0))
        return profile

    try:
        cells, profiles = run_grid(af, ray, cluster, calibrate_now, args)
    finally:
        cluster.shutdown()
    report = {"benchmark": "planner", "machine": machine_facts(), "profiles": [p.to_dict() for p in profiles],
              "settings": {k: v for k, v in vars(args).items() if k not in ("func",)},
              "summary": summarize(cells), "grid": cells}
    log(f"planner summary: {report['summary']}")
    write_json(args.out, report)
    _plot(report, args.out.replace(".json", ".png"))
    return report


def _plot(report: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    fig, ax = plt.subplots(figsize=(5.5, 5))
    for strategy in LINK_FREE + LINKED:
        xs = [c["measured_s"][strategy] for c in report["grid"]]
        ys = [c["predicted_s"][strategy] for c in report["grid"]]
        ax.scatter(xs, ys, s=14, label=strategy)
    top = max(max(c["measured_s"].values()) for c in report["grid"]) * 1.1
    ax.plot([0, top], [0, top], "k:", linewidth=1)
    ax.set(xscale="log", yscale="log", xlabel="measured wall time (s)", ylabel="predicted (s)",
           title=f"planner grid: median error {report['summary']['median_abs_rel_error']:.0%}")
    ticks = [t for t in (0.5, 1, 2, 5, 10, 20, 50, 100, 200) if t <= top]
    for axis in (ax.xaxis, ax.yaxis):  # plain seconds, no crowded minor labels
        axis.set_major_locator(matplotlib.ticker.FixedLocator(ticks))
        axis.set_major_formatter(matplotlib.ticker.ScalarFormatter())
        axis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    log(f"wrote {path}")
