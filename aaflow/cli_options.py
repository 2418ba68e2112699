"""Options shared by several `aaflow` commands."""

DTYPE_ARG = ["auto", "bfloat16", "float32"]
DTYPE_HELP = "weights and KV (default auto: bfloat16 on CPUs with native bf16, else float32)"
