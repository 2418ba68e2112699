"""fp32 attention on CPUs without native bf16: decode through the compiled kernel (alone, and as
cascade's remainder), and prefill chunks through `TiledPrefillBatch` with flash (a mixed step's
decode tokens as kernel rows), each against the torch paths they replaced. Needs a C++ compiler."""

from __future__ import annotations

import shutil

import pytest
import torch

from aaflow.models.tiny import make_tiny_model

pytestmark = pytest.mark.skipif(shutil.which("c++") is None and shutil.which("g++") is None,
                                reason="no C++ compiler here: the decode kernel cannot be built")


def test_fp32_engine_decode_through_the_kernel_is_its_torch_paths(make_engine, tmp_path):
    """fp32 with 64-dim heads decodes through the kernel (alone, and as cascade's remainder when a
    batch shares a prefix); its logits match the torch paths' to fp32 summation order, and so do
    its greedy tokens."""
    folder = make_tiny_model(tmp_path / "tiny64", "llama", hidden_size=256, num_attention_heads=4,
                             num_key_value_heads=2, num_hidden_layers=2)
    engines = [make_engine(folder, num_blocks=128, dtype="float32") for _ in range(2)]
    assert engines[0].runner.paths.kernel_decode
    engines[1].runner.paths.kernel_decode = False
    shared = [3 + (i * 7) % 250 for i in range(160)]
    logits, kinds = [], []
    for engine in engines:
        real = engine.runner.paths.decode
        engine.runner.paths.decode = lambda *a, real=real: kinds.append(type(real(*a)).__name__) or real(*a)
        a, b = engine.new_sequence(), engine.new_sequence()
        engine.prefill(a, [3 + (i * 7) % 250 for i in range(150)])
        engine.prefill(b, [5 + (i * 11) % 250 for i in range(90)])
        steps = [engine.decode([a, b], [10 + i, 20 + i]) for i in range(8)] + [engine.decode([a], [40])]
        forks = [engine.new_sequence() for _ in range(12)]
        for n, seq in enumerate(forks):
            engine.prefill(seq, shared + [9 + n] * (5 + n))
        steps += [engine.decode(forks, [30 + i + n for n in range(12)]) for i in range(3)]
        logits.append(torch.cat(steps).float())
        for seq in [a, b, *forks]:
            engine.free(seq)
    assert kinds[:12] == ["KernelDecodeBatch"] * 9 + ["CascadeBatch"] * 3
    kernel, torch_paths = logits
    assert float((kernel - torch_paths).abs().max() / torch_paths.abs().max()) <= 1e-5
    assert torch.equal(kernel.argmax(-1), torch_paths.argmax(-1))


def test_fp32_mixed_step_rows_go_to_the_kernel_and_match_the_masked_path(make_engine, tmp_path, monkeypatch):
    """fp32 prefill chunks go through `TiledPrefillBatch` with flash: a mixed step's one-token chunks
    (decoding sequences) as kernel rows, a long prompt after a cached prefix through flash; the
    logits match the masked per-sequence path's to fp32 summation order."""
    from aaflow.engine.tiled_attention import TiledPrefillBatch

    monkeypatch.delenv("AAFLOW_PREFILL_ATTENTION", raising=False)
    folder = make_tiny_model(tmp_path / "tiny64", "llama", hidden_size=256, num_attention_heads=4,
                             num_key_value_heads=2, num_hidden_layers=2)
    engines = [make_engine(folder, num_blocks=128, dtype="float32") for _ in range(2)]
    paths = engines[0].runner.paths
    assert paths.tiled_prefill and paths.flash_prefill and paths.kernel_decode
    engines[1].runner.paths.tiled_prefill = False
    batches, logits = [], []
    real = paths.prefill
    paths.prefill = lambda *a: batches.append(real(*a)) or batches[-1]
    header = [7 + i for i in range(32)]
    for engine in engines:
        olds = [engine.new_sequence() for _ in range(3)]
        for n, seq in enumerate(olds):
            engine.prefill(seq, header + [3 + (i * (5 + n)) % 250 for i in range(100 + 40 * n)])
        new = engine.new_sequence()
        out, _ = engine.prefill_packed(olds + [new], [[11], [12], [13], header + [9 + i % 200 for i in range(90)]],
                                       [False] * 3 + [True])
        logits.append(out.float())
        for seq in olds + [new]:
            engine.free(seq)
    step = batches[-1]
    assert isinstance(step, TiledPrefillBatch) and step.flash and step.tiled == [3]
    assert step.rows is not None and len(step.rows.lengths) == 3
    assert float((logits[0] - logits[1]).abs().max() / logits[1].abs().max()) <= 1e-5
    assert torch.equal(logits[0].argmax(-1), logits[1].argmax(-1))
