"""`aaflow up | status | down | submit`: a deployment on a running Ray cluster, shared by clients."""

from __future__ import annotations

import json
import os

from aaflow.cli_options import DTYPE_ARG, DTYPE_HELP, parse_engines
from aaflow.serving import DEFAULT_HOST, DEFAULT_PORT, serve
from aaflow.runtime.run_options import PREFIX_FETCH
from aaflow.serving.api_key import API_KEY_ENV
from aaflow.submission import submit
from aaflow.cluster.deployment import down, status, up
from aaflow.cluster.scheduler_actor import LEASE_S

ADDRESS_HELP = "the Ray cluster (`ray start --head` prints it, e.g. 127.0.0.1:6379); default: RAY_ADDRESS"
STRATEGIES = ["auto", "text", "recompute", "transfer", "stream", "transfer+stream"]


def parse_replicas(values: list[str]) -> dict[str, int]:
    """`--replicas MODEL=N` values (repeatable; a model name or an HF folder) -> {model: N}."""
    replicas: dict[str, int] = {}
    for value in values:
        model, _, count = value.rpartition("=")
        if not model or not count.isdigit() or int(count) < 1:
            raise SystemExit(f"aaflow: --replicas {value!r}: write MODEL=N with N >= 1, e.g. --replicas smollm2=2")
        replicas[model] = int(count)
    return replicas


def _up(args) -> int:
    engine, engines = parse_engines(args.engine)
    options = {"kv_cache_bytes": args.kv_cache_bytes} if args.kv_cache_bytes else {}
    cluster = up(parse_replicas(args.replicas or ["smollm2=2"]), address=args.address, dtype=args.dtype,
                 engine=engine, engines=engines, client_lease_s=args.client_lease_s, **options)
    try:
        for r in cluster.replicas():
            print(f"{r.name}: {r.model} ({r.engine}, {r.cpus:g} CPU, {cluster.info[r.name]['dtype']})")
        print(f"aaflow deployment up: {len(cluster.replicas())} replicas; "
              f"submit with `aaflow submit WORKFLOW.yaml --address {args.address or '$RAY_ADDRESS'}`")
    finally:
        cluster.shutdown()
    return 0


def _status(args) -> int:
    rows = status(args.address)
    if args.json:
        print(json.dumps(rows, indent=2, default=str))
        return 0
    mib = 2**20
    print(f"{'replica':<24} {'model':<16} {'cpus':>4} {'held MiB':>9} {'pinned':>8} {'evictable':>9} "
          f"{'queue':>5} {'computed':>9} {'reused':>9} {'busy s':>7}")
    for r in rows:
        print(f"{r['name'][-24:]:<24} {r['model'][-16:]:<16} {r['cpus']:>4g} {r['kv_bytes_held'] / mib:>9.1f} "
              f"{r['kv_bytes_pinned'] / mib:>8.1f} {r['kv_bytes_evictable'] / mib:>9.1f} {r['queue_depth']:>5} "
              f"{r['prefill_tokens_computed']:>9} {r['prefill_tokens_reused']:>9} {r['busy_s']:>7.1f}")
    return 0


def _down(args) -> int:
    names = down(args.address)
    print(f"aaflow deployment down: stopped {', '.join(names)}")
    return 0


def _submit(args) -> int:
    def finished(name: str, text: str) -> None:
        print(f"--- {name} ---\n{text.strip()}\n", flush=True)

    res = submit(args.workflow, args.address, strategy=args.strategy, on_agent=finished)
    print(res.summary())
    totals = {k: v for k, v in res.metrics.items() if k != "agents"}
    print("metrics: " + json.dumps(totals), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"metrics": res.metrics, "agents": {n: {"text": a.text, "token_ids": a.token_ids}
                                                          for n, a in res.agents.items()}}, f, indent=2)
    return 0


def _serve(args) -> int:
    serve(args.address, host=args.host, port=args.port, default_max_tokens=args.max_tokens,
          api_key=args.api_key if args.api_key is not None else os.environ.get(API_KEY_ENV),
          allow_no_key=args.allow_no_key, prefix_fetch=args.prefix_fetch)
    return 0


def add_deploy_commands(sub) -> None:
    """Add up, status, down, submit and serve to the `aaflow` subcommands."""
    up = sub.add_parser("up", help="start a long-lived deployment (detached replicas) on a running Ray cluster")
    up.add_argument("--address", default=None, help=ADDRESS_HELP)
    up.add_argument("--replicas", action="append", metavar="MODEL=N",
                    help="replicas of a model (a name or HF folder), repeatable (default smollm2=2)")
    up.add_argument("--dtype", default="auto", choices=DTYPE_ARG, help=DTYPE_HELP)
    up.add_argument("--engine", action="append", default=[], metavar="[MODEL=]ENGINE", help="builtin (default) or vllm")
    up.add_argument("--kv-cache-bytes", default=None, metavar="SIZE",
                    help="each built-in replica's KV pool, e.g. 2GiB (default: 10%% of memory shared by the replicas)")
    up.add_argument("--client-lease-s", type=float, default=LEASE_S, metavar="S",
                    help="a client process not heard from this long is gone: its runs are cancelled (default %(default)g)")
    up.set_defaults(func=_up)

    st = sub.add_parser("status", help="a deployment's replicas: cores, KV held / pinned / evictable, queue depth")
    st.add_argument("--address", default=None, help=ADDRESS_HELP)
    st.add_argument("--json", action="store_true", help="print the rows as JSON")
    st.set_defaults(func=_status)

    down = sub.add_parser("down", help="stop a deployment's replicas")
    down.add_argument("--address", default=None, help=ADDRESS_HELP)
    down.set_defaults(func=_down)

    submit = sub.add_parser("submit", help="run a workflow YAML on a running deployment; prints agents as they finish")
    submit.add_argument("workflow")
    submit.add_argument("--address", default=None, help=ADDRESS_HELP)
    submit.add_argument("--strategy", default="auto", choices=STRATEGIES)
    submit.add_argument("--json", default=None, help="also write texts, token ids and metrics here")
    submit.set_defaults(func=_submit)

    serve = sub.add_parser("serve", help="an OpenAI-compatible HTTP API (/v1/chat/completions, /v1/completions, "
                                         "/v1/models, /metrics) for a running deployment")
    serve.add_argument("--address", default=None, help=ADDRESS_HELP)
    serve.add_argument("--host", default=DEFAULT_HOST, help="interface to listen on (default loopback only)")
    serve.add_argument("--port", type=int, default=DEFAULT_PORT)
    serve.add_argument("--max-tokens", type=int, default=None, help="for requests that name none (default 256)")
    serve.add_argument("--api-key", default=None, metavar="KEY",
                       help=f"every route but /health asks for 'Authorization: Bearer KEY' (default: ${API_KEY_ENV})")
    serve.add_argument("--allow-no-key", action="store_true",
                       help="serve without an API key on an interface other machines can reach")
    serve.add_argument("--prefix-fetch", default="auto", choices=PREFIX_FETCH,
                       help="how a replica lacking a request's shared prefix gets it: the cost model chooses "
                            "(auto, the default), always moved from a replica holding it, or always computed")
    serve.set_defaults(func=_serve)
