"""Options shared by several `aaflow` commands."""

DTYPE_ARG = ["auto", "bfloat16", "float32"]
DTYPE_HELP = "weights and KV (default auto: bfloat16 on CPUs with native bf16, else float32)"


def parse_engines(values: list[str]) -> tuple[str, dict[str, str]]:
    """`--engine` values ("vllm", or "MODEL=vllm" per model) -> (default engine, {model: engine})."""
    engine, engines = "builtin", {}
    for value in values:
        model, _, kind = value.rpartition("=")
        if kind not in ("builtin", "vllm"):
            raise SystemExit(f"aaflow: --engine {value!r}: the engine must be 'builtin' or 'vllm' "
                             "(for every model, or MODEL=vllm for one)")
        if model:
            engines[model] = kind
        else:
            engine = kind
    return engine, engines
