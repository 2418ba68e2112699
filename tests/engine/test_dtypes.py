"""dtype names and "auto": bf16 only where the CPU computes in bf16 natively."""

import argparse

import pytest
import torch

from aaflow.engine.dtypes import native_bf16, resolve_dtype
from aaflow.benchmarks.common import add_dtype_argument


def test_auto_follows_the_cpu():
    assert resolve_dtype("auto") == ("bfloat16" if native_bf16() else "float32")
    assert native_bf16() == bool(torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported())


@pytest.mark.parametrize("name", ["float32", "bfloat16", "float16"])
def test_concrete_names_pass_through(name):
    assert resolve_dtype(name) == name


def test_unknown_dtype_names_the_choices():
    with pytest.raises(ValueError, match=r"'fp8'.*auto.*bfloat16"):
        resolve_dtype("fp8")


def test_engine_resolves_auto(tiny_llama_dir, make_engine):
    engine = make_engine(tiny_llama_dir, dtype="auto", num_blocks=8)
    assert engine.dtype == getattr(torch, resolve_dtype("auto"))


def test_bench_dtype_argument_resolves_when_parsed():
    p = argparse.ArgumentParser()
    add_dtype_argument(p)
    assert p.parse_args([]).dtype == resolve_dtype("auto")
    assert p.parse_args(["--dtype", "bfloat16"]).dtype == "bfloat16"
    with pytest.raises(SystemExit):
        p.parse_args(["--dtype", "int4"])


def test_bench_pools_scale_with_the_dtype():
    from aaflow.benchmarks.common import kv_bytes_per_token

    assert kv_bytes_per_token("bfloat16") == 23040  # SmolLM2: 30 layers x K/V x 3 heads x 64 x 2 bytes
    assert kv_bytes_per_token("float32") == 46080
