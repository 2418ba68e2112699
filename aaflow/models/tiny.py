"""Tiny random-weight Llama / Qwen2 folders with a byte-level tokenizer: the models tests, the fuzzer
and the soak run on (fast, no download; their text is meaningless)."""

from __future__ import annotations

from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

TINY_VOCAB = 320  # 256 byte tokens + 2 specials, padded


def save_byte_tokenizer(folder: Path) -> None:
    """A byte-level BPE with no merges: every byte is a token; <s> = 256, </s> = 257."""
    vocab = {ch: i for i, ch in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>")
    fast.chat_template = ("{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}"
                          "{% if add_generation_prompt %}[assistant] {% endif %}")
    fast.save_pretrained(folder)


def tiny_config(arch: str, **overrides):
    common = dict(
        vocab_size=TINY_VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        bos_token_id=256, eos_token_id=257, initializer_range=0.2,
    )
    common.update(overrides)
    if arch == "llama":
        return LlamaConfig(rope_theta=10000.0, tie_word_embeddings=False, **common)
    if arch == "qwen2":
        return Qwen2Config(rope_theta=1e6, tie_word_embeddings=True, **common)
    raise ValueError(arch)


def make_tiny_model(folder: Path, arch: str, seed: int = 0, **overrides) -> Path:
    """Save a random-weight model of `arch` ("llama" or "qwen2") as an HF folder; returns it."""
    torch.manual_seed(seed)
    config = tiny_config(arch, **overrides)
    model = (LlamaForCausalLM if arch == "llama" else Qwen2ForCausalLM)(config)
    if arch == "qwen2":  # random biases so the q/k/v bias path is really exercised
        for layer in model.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                torch.nn.init.normal_(proj.bias, std=0.2)
    model.save_pretrained(folder)
    save_byte_tokenizer(folder)
    return folder
