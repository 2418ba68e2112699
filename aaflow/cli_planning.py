"""`aaflow plan`, `aaflow breakeven`, `aaflow calibrate`: the cost model from the command line."""

from __future__ import annotations

import json
import sys
from dataclasses import replace
from pathlib import Path

import aaflow as af
from aaflow.cli_options import DTYPE_ARG, DTYPE_HELP
from aaflow.cluster.planning import replica_infos
from aaflow.costmodel.hardware import available_hardware, hardware_dir, load_hardware
from aaflow.costmodel.model_profile import model_profile
from aaflow.costmodel.profile_store import covers, default_profile_name, find_profile
from aaflow.costmodel.units import format_bandwidth, format_seconds
from aaflow.costmodel.whatif import break_even_bandwidth, break_even_context, transfer_speedup


def _hardware_name(name: str | None) -> str | None:
    """A profile name, path, or unique prefix of a shipped one ("a100" -> "a100-80gb")."""
    if name is None or name in available_hardware() or name.endswith((".yaml", ".yml")):
        return name
    matches = [h for h in available_hardware() if h.startswith(name)]
    return matches[0] if len(matches) == 1 else name


def _plan(args) -> int:
    wf = af.load_workflow(args.workflow)
    replicas = {a.model: args.replicas for a in wf.agents()}
    hardware = _hardware_name(args.hardware)
    cluster = None
    if hardware is None:
        if not covers(find_profile(), replica_infos(replicas, args.dtype)):  # calibrating needs live replicas
            print(f"aaflow plan: this machine has no calibrated profile for {', '.join(replicas)} in {args.dtype} yet; "
                  "starting replicas to calibrate ...")
            cluster = af.init(replicas=replicas, dtype=args.dtype)
    try:
        plan = af.plan(wf, cluster or replicas, hardware=hardware, link=args.link, chunk_tokens=args.chunk_tokens,
                       dtype=args.dtype)
    finally:
        if cluster is not None:
            cluster.shutdown()
    print(plan.explain())
    if args.json:
        with open(args.json, "w") as f:
            json.dump(plan.to_dict(), f, indent=2)
        print(f"wrote {args.json}")
    return 0


def _breakeven(args) -> int:
    """Transfer vs recompute what-ifs for a model on a hardware profile."""
    hardware = _hardware_name(args.hardware)
    if hardware is None:
        profile = find_profile()
        if profile is None:
            print("aaflow breakeven: no calibrated profile here; run `aaflow calibrate` or pass --hardware NAME",
                  file=sys.stderr)
            return 2
    else:
        profile = load_hardware(hardware)
    model = model_profile(args.model)
    key = next((k for k in profile.compute if k.split("|")[0] == args.model), None)
    if key is not None:
        model = replace(model, name=key)
    compute = profile.compute_for(model)
    label = "measured here" if profile.measured else "PROJECTION (public figures, not measured here)"
    print(f"{args.model} on {profile.name} ({label}); KV {model.kv_bytes_per_token:,} bytes/token")
    print(f"prefill of {args.context:,} tokens: {format_seconds(compute.prefill_time(args.context))}")
    print(f"break-even bandwidth at {args.context:,} tokens: "
          f"{format_bandwidth(break_even_bandwidth(model, compute, args.context))}")
    for name in args.link or sorted(profile.links):
        link = profile.link(name)
        context = break_even_context(model, compute, link)
        print(f"link {name}: transfer {format_seconds(link.transfer_time(args.context * model.kv_bytes_per_token))}, "
              f"{transfer_speedup(model, compute, link, args.context):.1f}x faster than prefill; transfer wins from "
              f"{f'{context:,} tokens' if context else 'no length up to 131,072 tokens'}")
    return 0


def _calibrate(args) -> int:
    name = args.name or default_profile_name()
    out = Path(args.out) if args.out else hardware_dir() / f"{name}.yaml"
    base = load_hardware(str(out)) if out.is_file() else None  # its entries for other models (dtypes, threads) stay
    cluster = af.init(replicas={args.model: args.replicas}, dtype=args.dtype)
    try:
        af.calibrate(cluster, name=name, quick=not args.full, out=out, base=base)
    finally:
        cluster.shutdown()
    return 0


def add_planning_commands(sub) -> None:
    """Register plan, breakeven and calibrate on the `aaflow` subcommand parser `sub`."""
    plan = sub.add_parser("plan", help="the planner's strategy per edge and predicted times for a workflow YAML")
    plan.add_argument("workflow")
    plan.add_argument("--replicas", type=int, default=2, help="replicas per model")
    plan.add_argument("--hardware", default=None,
                      help="a hardware profile (a100-80gb, h100, h200, a YAML path) for a projection; "
                           "default: this machine's calibrated profile")
    plan.add_argument("--link", default=None, help="link between replicas: a profile link name or e.g. 25Gbps")
    plan.add_argument("--chunk-tokens", type=int, default=16)
    plan.add_argument("--dtype", default="auto", choices=DTYPE_ARG, help=DTYPE_HELP)
    plan.add_argument("--json", default=None, help="also write the plan as JSON here")
    plan.set_defaults(func=_plan)

    breakeven = sub.add_parser("breakeven", help="when KV transfer beats recomputing: break-even bandwidth and context")
    breakeven.add_argument("--model", default="smollm2", help="a known model (smollm2, llama-3-8b, qwen3-8b)")
    breakeven.add_argument("--hardware", default=None, help="a profile (default: this machine's calibrated one)")
    breakeven.add_argument("--context", type=int, default=4096)
    breakeven.add_argument("--link", nargs="*", default=None, help="links: profile names or bandwidths (25Gbps)")
    breakeven.set_defaults(func=_breakeven)

    calibrate = sub.add_parser("calibrate", help="measure this machine's replicas and links into a hardware profile")
    calibrate.add_argument("--model", default="smollm2")
    calibrate.add_argument("--replicas", type=int, default=2, help="two or more also measure the links")
    calibrate.add_argument("--dtype", default="auto", choices=DTYPE_ARG, help=DTYPE_HELP)
    calibrate.add_argument("--name", default=None, help="profile name (default local-<hostname>)")
    calibrate.add_argument("--out", default=None,
                           help="YAML path (default aaflow/configs/hardware/<name>.yaml); a profile there keeps its entries "
                                "for models (dtypes, threads) not measured now")
    calibrate.add_argument("--full", action="store_true", help="a longer grid (several minutes)")
    calibrate.set_defaults(func=_calibrate)
