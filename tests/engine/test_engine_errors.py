"""Bad input gets a typed error that names the problem, and loses nothing already computed."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

import aaflow as af
from aaflow.engine import KVExport


def test_unknown_model_name_lists_the_registry():
    with pytest.raises(af.ModelNotFoundError, match="unknown model 'no-such-model'.*smollm2"):
        af.Engine.from_pretrained("no-such-model")


def test_missing_folder(tmp_path):
    with pytest.raises(af.ModelNotFoundError, match="does not exist"):
        af.Engine.from_pretrained(tmp_path / "nothing-here")


def test_folder_without_weights(tmp_path, tiny_llama_dir):
    for f in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tiny_llama_dir / f, tmp_path / f)
    with pytest.raises(af.ModelNotFoundError, match=r"missing \['\*.safetensors'\]"):
        af.Engine.from_pretrained(tmp_path)


def test_corrupt_weights(tmp_path, tiny_llama_dir):
    shutil.copytree(tiny_llama_dir, tmp_path / "m")
    (tmp_path / "m" / "model.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(af.ModelNotFoundError, match="not a readable safetensors file"):
        af.Engine.from_pretrained(tmp_path / "m")


def test_broken_config_json(tmp_path, tiny_llama_dir):
    shutil.copytree(tiny_llama_dir, tmp_path / "m")
    (tmp_path / "m" / "config.json").write_text("{ not json")
    with pytest.raises(af.ModelNotFoundError, match="not valid JSON"):
        af.Engine.from_pretrained(tmp_path / "m")


def _edit_config(src, dst, **changes):
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    cfg.update(changes)
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def test_unsupported_architecture(tmp_path, tiny_llama_dir):
    folder = _edit_config(tiny_llama_dir, tmp_path / "m", architectures=["GPT2LMHeadModel"])
    with pytest.raises(af.UnsupportedModelError, match="GPT2LMHeadModel.*LlamaForCausalLM"):
        af.Engine.from_pretrained(folder)


@pytest.mark.parametrize("rope_type", ["dynamic", "yarn"])
def test_unsupported_rope_scaling(tmp_path, tiny_llama_dir, rope_type):
    folder = _edit_config(tiny_llama_dir, tmp_path / "m",
                          rope_parameters={"rope_type": rope_type, "factor": 2.0, "rope_theta": 10000.0})
    with pytest.raises(af.UnsupportedModelError, match=f"RoPE scaling '{rope_type}'"):
        af.Engine.from_pretrained(folder)


def test_prompt_longer_than_positions(tiny_engine):
    with pytest.raises(af.PromptError, match="beyond the model's 512 positions"):
        tiny_engine.generate(list(range(10)) * 52, max_new_tokens=1)


def test_generation_past_positions_is_refused_before_it_starts(tiny_engine):
    s = tiny_engine.new_sequence()
    tiny_engine.prefill(s, [1] * 511)
    with pytest.raises(af.PromptError):
        tiny_engine.prefill(s, [1, 2])
    assert len(tiny_engine.sequence_tokens(s)) == 511
    tiny_engine.free(s)


def test_pool_exhausted_names_needed_and_free_blocks_and_keeps_work(make_engine, tiny_llama_dir):
    engine = make_engine(tiny_llama_dir, num_blocks=8, prefix_caching=False)
    s = engine.new_sequence()
    engine.prefill(s, list(range(100)))  # 7 blocks
    with pytest.raises(af.KVCapacityError) as info:
        engine.prefill(s, list(range(60)))  # needs 4 more (160 tokens -> 10 blocks)
    assert (info.value.needed_blocks, info.value.free_blocks) == (3, 1)
    assert "need 3 blocks, 1 free" in str(info.value)
    assert len(engine.sequence_tokens(s)) == 100, "the failed request must not change the sequence"
    other = engine.new_sequence()
    with pytest.raises(af.KVCapacityError):
        engine.import_kv(engine.export_kv(s))
    engine.free(other)
    engine.free(s)


def test_empty_prompt(tiny_engine):
    with pytest.raises(af.PromptError, match="empty"):
        tiny_engine.generate("", max_new_tokens=4)
    with pytest.raises(af.PromptError, match="empty"):
        tiny_engine.generate([], max_new_tokens=4)


def test_token_ids_outside_vocabulary(tiny_engine):
    with pytest.raises(af.PromptError, match="outside the vocabulary"):
        tiny_engine.generate([1, 2, 100000], max_new_tokens=4)


@pytest.mark.parametrize("kwargs, match", [
    (dict(max_new_tokens=0), "max_new_tokens"),
    (dict(temperature=-1.0), "temperature"),
    (dict(temperature=float("nan")), "temperature"),
    (dict(top_p=0.0), "top_p"),
    (dict(top_p=1.5), "top_p"),
    (dict(stop=[""]), "stop"),
])
def test_bad_sampling_values(tiny_engine, kwargs, match):
    with pytest.raises(af.SamplingError, match=match):
        tiny_engine.generate("hello", **kwargs)


def test_unknown_sequence(tiny_engine):
    with pytest.raises(af.SequenceError, match="unknown sequence 999"):
        tiny_engine.prefill(999, [1])
    s = tiny_engine.new_sequence()
    tiny_engine.free(s)
    with pytest.raises(af.SequenceError, match="already freed"):
        tiny_engine.free(s)


def test_import_checks_fingerprint_shape_and_dtype_before_touching_memory(tiny_engine, make_engine, tiny_qwen2_dir):
    s = tiny_engine.new_sequence()
    tiny_engine.prefill(s, list(range(40)))
    good = tiny_engine.export_kv(s)
    tiny_engine.free(s)
    before = tiny_engine.stats()
    bad = [
        KVExport("0" * 64, good.token_ids, good.kv),
        KVExport(good.fingerprint, good.token_ids, good.kv[:, :, :-1]),
        KVExport(good.fingerprint, good.token_ids, good.kv.to(torch.bfloat16)),
    ]
    for export, match in zip(bad, ["computed by model", "shape", "dtype"]):
        with pytest.raises(af.KVImportError, match=match):
            tiny_engine.import_kv(export)
    qwen = make_engine(tiny_qwen2_dir, num_blocks=8)
    with pytest.raises(af.KVImportError, match="computed by model"):
        qwen.import_kv(good)
    assert tiny_engine.stats().free == before.free


def test_bad_dtype_name(tiny_llama_dir):
    with pytest.raises(ValueError, match="unknown dtype 'int8': choose one of auto"):
        af.Engine.from_pretrained(tiny_llama_dir, dtype="int8")
