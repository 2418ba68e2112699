"""The cost model's inputs: units (bandwidths, durations), model profiles (known models, Hugging
Face configs, safetensors folders) and hardware profiles (the shipped YAML projections, round trips,
link strings, compute derived or scaled).

Pure and fast: no Ray, no model weights. The timing formulas over these: test_costmodel_formulas.py.
"""

from __future__ import annotations

import json
import math
from dataclasses import replace

import numpy as np
import pytest

from aaflow.common.errors import CostModelError
from aaflow.costmodel.hardware import HardwareProfile, LinkProfile, available_hardware, hardware_dir, load_hardware
from aaflow.costmodel.model_profile import KNOWN_MODELS, ModelProfile, estimate_params, model_profile
from aaflow.costmodel.units import format_bandwidth, format_seconds, gbps, parse_bandwidth, parse_duration

LLAMA3_8B_CONFIG = {"model_type": "llama", "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
                    "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 128256,
                    "tie_word_embeddings": False}
QWEN3_8B_CONFIG = {"model_type": "qwen3", "hidden_size": 4096, "intermediate_size": 12288, "num_hidden_layers": 36,
                   "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 151936,
                   "tie_word_embeddings": False}
SMOLLM2_CONFIG = {"model_type": "llama", "hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30,
                  "num_attention_heads": 9, "num_key_value_heads": 3, "vocab_size": 49152,
                  "tie_word_embeddings": True}


# --- units -------------------------------------------------------------------------------
@pytest.mark.parametrize("text, expected", [
    ("25Gbps", 3.125e9), ("25 Gb/s", 3.125e9), ("100 Mbps", 12.5e6), ("3GB/s", 3e9), ("3 GBps", 3e9),
    ("500MB/s", 5e8), ("1.5 GiB/s", 1.5 * 2**30), (3e9, 3e9), (7, 7.0), ("2e9", 2e9),
])
def test_parse_bandwidth(text, expected):
    assert parse_bandwidth(text) == pytest.approx(expected, rel=1e-12), f"{text!r} -> {parse_bandwidth(text)}"


@pytest.mark.parametrize("bad", ["25 furlongs", "fast", "25G", "-3GB/s", "0Gbps", ""])
def test_parse_bandwidth_rejects_naming_the_value(bad):
    with pytest.raises(CostModelError, match="bandwidth") as info:
        parse_bandwidth(bad)
    assert repr(bad) in str(info.value)


def test_parse_duration_and_gbps():
    assert gbps(25) == 3.125e9
    for text, seconds in [("50us", 50e-6), ("50µs", 50e-6), ("1ms", 1e-3), ("0.2s", 0.2), (0.3, 0.3), ("10ns", 1e-8)]:
        assert parse_duration(text) == pytest.approx(seconds), text
    with pytest.raises(CostModelError, match="'1 fortnight'"):
        parse_duration("1 fortnight")


def test_format():
    assert format_bandwidth(3.125e9) == "3.12 GB/s (25.0 Gbps)"
    assert format_seconds(0.0123) == "12.3 ms"
    assert format_seconds(1.2) == "1.20 s"
    assert format_seconds(45e-6) == "45 µs"


# --- model profiles ----------------------------------------------------------------------
def test_kv_bytes_and_flops_per_token():
    llama = model_profile("llama-3-8b")
    assert llama.kv_bytes_per_token == 32 * 2 * 8 * 128 * 2 == 131072
    assert model_profile("smollm2").kv_bytes_per_token == 30 * 2 * 3 * 64 * 2 == 23040
    assert llama.flops_per_token == pytest.approx(16.06e9, rel=1e-3)
    assert llama.weight_bytes == 2 * 8_030_261_248
    assert llama.attention_flops_per_token_per_context_token == 4 * 32 * 32 * 128
    with pytest.raises(CostModelError, match="llama-3-8b"):
        model_profile("gpt-5")


@pytest.mark.parametrize("name, config", [("llama-3-8b", LLAMA3_8B_CONFIG), ("qwen3-8b", QWEN3_8B_CONFIG),
                                          ("smollm2", SMOLLM2_CONFIG)])
def test_from_hf_config_matches_known(name, config):
    assert estimate_params(config) == KNOWN_MODELS[name].params
    assert ModelProfile.from_hf_config(name, config) == KNOWN_MODELS[name]
    assert ModelProfile.from_hf_config(name, config, dtype="float32").kv_bytes_per_token == \
        2 * KNOWN_MODELS[name].kv_bytes_per_token


def test_from_folder_counts_safetensors_params(tmp_path):
    safetensors_numpy = pytest.importorskip("safetensors.numpy")
    config = dict(SMOLLM2_CONFIG, num_hidden_layers=2)
    (tmp_path / "config.json").write_text(json.dumps(config))
    safetensors_numpy.save_file({"a": np.zeros((3, 5), np.float32), "b": np.zeros(7, np.float32)},
                                str(tmp_path / "model.safetensors"))
    profile = ModelProfile.from_folder("tiny", tmp_path)
    assert profile.params == 22 and profile.layers == 2 and profile.kv_bytes_per_token == 2 * 2 * 3 * 64 * 2
    with pytest.raises(CostModelError, match="config.json"):
        ModelProfile.from_folder("none", tmp_path / "missing")


# --- hardware profiles -------------------------------------------------------------------
def test_shipped_profiles_load_as_projections():
    assert {"a100-80gb", "h100", "h200"} <= set(available_hardware())
    assert (hardware_dir() / "a100-80gb.yaml").is_file()
    for name in ("a100-80gb", "h100", "h200"):
        hw = load_hardware(name)
        assert hw.measured is False and hw.source.strip(), name
        assert {"nvlink", "pcie", "ib-200g", "ib-400g", "eth-25g", "eth-100g"} <= set(hw.links), name
        assert hw.link("ib-200g").bandwidth_bytes_per_s == pytest.approx(gbps(200))
        assert hw.memcpy_bytes_per_s == pytest.approx(hw.memory_bytes_per_s / 2)
    with pytest.raises(CostModelError, match="a100-80gb"):
        load_hardware("tpu-v9")


def test_yaml_round_trip_and_unknown_keys(tmp_path):
    hw = replace(load_hardware("a100-80gb").with_link("ray", LinkProfile(5e9, 1e-4)), call_overhead_s=2e-3)
    path = tmp_path / "hw.yaml"
    hw.save(path)
    assert HardwareProfile.load(path) == hw
    assert load_hardware(str(path)) == hw
    bad = hw.to_dict()
    bad["bogus_key"] = 1
    with pytest.raises(CostModelError, match="bogus_key"):
        HardwareProfile.from_dict(bad)
    bad = hw.to_dict()
    bad["links"]["ray"]["speed"] = 3
    with pytest.raises(CostModelError, match="speed"):
        HardwareProfile.from_dict(bad)
    units = dict(hw.to_dict(), memcpy_bytes_per_s="20 GB/s", links={"x": {"bandwidth_bytes_per_s": "25Gbps",
                                                                           "latency_s": "10us"}})
    parsed = HardwareProfile.from_dict(units)
    assert parsed.memcpy_bytes_per_s == 2e10 and parsed.links["x"] == LinkProfile(3.125e9, 1e-5)


def test_link_strings_and_compute_for():
    hw = load_hardware("h100")
    assert hw.link("25Gbps") == LinkProfile(3.125e9, 0.0)
    assert hw.link("25Gbps,10us") == LinkProfile(3.125e9, 1e-5)
    with pytest.raises(CostModelError, match="nvlink"):
        hw.link("warp-drive")
    assert LinkProfile(math.inf, 1e-3).transfer_time(10**9) == 1e-3  # a link that costs only its latency
    llama = model_profile("llama-3-8b")
    derived = hw.compute_for(llama)
    assert derived.prefill_s_per_token == pytest.approx(llama.flops_per_token / (989e12 * 0.5))
    assert derived.decode_fixed_s == pytest.approx(llama.weight_bytes / 3.35e12)
    assert derived.decode_s_per_seq_ctx == pytest.approx(131072 / 3.35e12)
    a100 = load_hardware("a100-80gb")
    assert a100.compute_for(KNOWN_MODELS["qwen3-8b"]) is a100.compute["qwen3-8b"]
    bare = HardwareProfile("cpu", True, "test", memcpy_bytes_per_s=2e10)
    with pytest.raises(CostModelError, match="aaflow calibrate"):
        bare.compute_for(llama)


def test_scaled_compute_scales_every_term_and_rejects_bad_factors():
    from aaflow.costmodel.hardware import ComputeProfile, HardwareProfile

    c = ComputeProfile(0.1, 1e-3, 1e-6, 0.05, 1e-3, 1e-5)
    twice = c.scaled(2.0)
    assert twice.prefill_time(300, 100) == pytest.approx(2 * c.prefill_time(300, 100))
    assert twice.decode_step_time(4, 1000) == pytest.approx(2 * c.decode_step_time(4, 1000))
    for bad in (0.0, -1.0, float("inf"), float("nan")):
        with pytest.raises(CostModelError, match="factor"):
            c.scaled(bad)
    hw = HardwareProfile(name="t", measured=True, source="test", memcpy_bytes_per_s=1e9, compute={"a": c, "b": c})
    slow = hw.with_compute_scaled({"a": 1.5})
    assert slow.compute["a"].decode_fixed_s == pytest.approx(0.075) and slow.compute["b"] == c
    split = hw.with_compute_scaled({"a": 1.5}, decode_factors={"a": 0.5}).compute["a"]
    assert split.prefill_time(300, 100) == pytest.approx(1.5 * c.prefill_time(300, 100))
    assert split.decode_step_time(4, 1000) == pytest.approx(0.5 * c.decode_step_time(4, 1000))
    with pytest.raises(CostModelError, match="decode_factor"):
        c.scaled(1.0, 0.0)


def test_the_profile_named_by_the_environment_wins_and_a_missing_one_is_a_clear_error(tmp_path, monkeypatch):
    from aaflow.costmodel.profile_store import PROFILE_ENV, find_profile

    measured = replace(load_hardware("h100"), name="on-the-deployment", links={"nixl": LinkProfile(1.25e7, 1e-3)})
    path = tmp_path / "deployment.yaml"
    measured.save(path)
    monkeypatch.setenv(PROFILE_ENV, str(path))
    found = find_profile()
    assert found.name == "on-the-deployment" and found.links["nixl"].bandwidth_bytes_per_s == 1.25e7
    monkeypatch.setenv(PROFILE_ENV, str(tmp_path / "absent.yaml"))
    with pytest.raises(CostModelError, match="AAFLOW_HARDWARE_PROFILE names .*absent.yaml"):
        find_profile()
