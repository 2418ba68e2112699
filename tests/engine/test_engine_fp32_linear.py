"""fp32 products on oneDNN where MKL's GEMM is not tuned for the CPU (AMD's): same values as torch's
default path to fp32 rounding, at every row count a decode step, a pack or a prefill uses."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from aaflow.engine.linear import Linear, fp32_on_onednn
from aaflow.common.machine import cpu_vendor


def test_fp32_goes_to_onednn_on_amd_only_and_bf16_never():
    assert fp32_on_onednn(torch.float32) == (cpu_vendor() == "amd" and torch.backends.mkldnn.is_available())
    assert not fp32_on_onednn(torch.bfloat16)


@pytest.mark.parametrize("rows", [0, 1, 2, 17, 300])
@pytest.mark.parametrize("bias", [False, True])
def test_a_onednn_fp32_product_equals_torchs_to_rounding(rows, bias):
    gen = torch.Generator().manual_seed(rows)
    weight = torch.randn(96, 64, generator=gen)  # [out, in]
    b = torch.randn(96, generator=gen) if bias else None
    x = torch.randn(rows, 128, generator=gen)[:, ::2]  # [rows, 64], not contiguous
    layer = Linear(weight, b, prepack=False, onednn=True)
    assert layer.on_onednn
    for invariant in (False, True):
        torch.testing.assert_close(layer(x, batch_invariant=invariant), F.linear(x, weight, b), rtol=1e-5, atol=1e-4)


def test_the_loader_follows_the_rule(tiny_llama_dir):
    from aaflow.engine.config import ModelConfig
    from aaflow.engine.weights import load_weights

    weights = load_weights(tiny_llama_dir, ModelConfig.from_folder(tiny_llama_dir), torch.float32)
    layers = [weights.lm_head] + [getattr(w, name) for w in weights.layers for name in ("qkv", "o", "gate_up", "down")]
    assert {layer.on_onednn for layer in layers} == {fp32_on_onednn(torch.float32)}


@pytest.mark.smollm2
def test_deterministic_fp32_is_batch_invariant_where_products_otherwise_go_to_mkl(smollm2_dir, monkeypatch):
    """Deterministic mode keeps its products on oneDNN even where fp32 otherwise runs on MKL (not AMD),
    whose GEMM rounds a row by the number of rows in the call: a decode step of one or two sequences
    and a chunked prefill give the one-pass prefill's logits bit for bit."""
    import aaflow.engine.weights as weights
    from aaflow.engine import Engine

    monkeypatch.setattr(weights, "fp32_on_onednn", lambda dtype: False)
    engine = Engine.from_pretrained(smollm2_dir, dtype="float32", deterministic=True, prefix_caching=False,
                                    kv_cache_bytes=64 * 2**20)
    prompt = torch.randint(1000, 40000, (160,), generator=torch.Generator().manual_seed(7)).tolist()
    seqs = []

    def prefilled(ids: list[int], **options) -> torch.Tensor:
        seqs.append(engine.new_sequence())
        return engine.prefill(seqs[-1], ids, **options)

    try:
        one_pass = prefilled(prompt, all_logits=True)  # [160, vocab]
        assert torch.equal(prefilled(prompt, chunk_size=57, all_logits=True), one_pass)
        prefilled(prompt[:100])
        prefilled(prompt[:150])
        a, b = seqs[2:]
        assert torch.equal(engine.decode([b], [prompt[150]]), one_pass[[150]])
        assert torch.equal(engine.decode([a, b], [prompt[100], prompt[151]]), one_pass[[100, 151]])
    finally:
        for seq in seqs:
            engine.free(seq)
