"""The default bf16 engine on a CPU with AMX (not deterministic mode): a token's logits are
bit-identical however its prompt was chunked or packed (in pieces of more than 8 tokens: shorter
ones take the decode kernel, as decode steps do) and whatever decode batch it runs in, as long as
cascade attention stays off (fewer than 8 sequences sharing a prefix). Chunks of 200 and 256 rows
are row counts at which oneDNN reorders the down projection's sums (2 threads)."""

from __future__ import annotations

import pytest
import torch

from aaflow.engine.linear import amx_linear_kernel

pytestmark = [pytest.mark.smollm2,
              pytest.mark.skipif(amx_linear_kernel() is None, reason="needs a CPU with AMX and a C++ compiler")]

PROMPT_LEN = 620  # no chunk size below leaves a last piece of 8 tokens or fewer


@pytest.fixture(scope="module")
def engine(smollm2_dir):
    from aaflow.engine import Engine

    engine = Engine.from_pretrained(smollm2_dir, dtype="bfloat16", prefix_caching=False, kv_cache_bytes=128 * 2**20)
    yield engine
    assert engine.stats().used == 0


@pytest.fixture(scope="module")
def prompt():
    return torch.randint(1000, 40000, (PROMPT_LEN,), generator=torch.Generator().manual_seed(11)).tolist()


def _prefill(engine, ids, chunk=None):
    seq = engine.new_sequence()
    try:
        return engine.prefill(seq, ids, chunk_size=chunk, all_logits=True)  # [len(ids), vocab]
    finally:
        engine.free(seq)


@pytest.mark.parametrize("chunk", [16, 200, 256])
def test_chunked_prefill_gives_one_pass_logits_bit_for_bit(engine, prompt, chunk):
    one_pass = _prefill(engine, prompt)
    assert torch.equal(_prefill(engine, prompt, chunk), one_pass), f"chunks of {chunk}"


def test_a_decode_row_gets_the_same_logits_alone_batched_and_beside_a_prefill(engine, prompt):
    seqs = [engine.new_sequence() for _ in range(4)]
    try:
        for seq, start in zip(seqs, (0, 50, 100, 150)):
            engine.prefill(seq, prompt[start:start + 400])
        forks = [engine.fork(seqs[0]) for _ in range(2)]  # three copies of one context
        seqs += forks
        alone = engine.decode([seqs[0]], [prompt[400]])[0]
        batched = engine.decode([forks[0], *seqs[1:4]], [prompt[400], 7, 8, 9])[0]
        other = engine.new_sequence()
        seqs.append(other)
        mixed, _ = engine.prefill_packed([forks[1], other], [[prompt[400]], prompt[:230]])
        assert torch.equal(batched, alone) and torch.equal(mixed[0], alone)
    finally:
        for seq in seqs:
            engine.free(seq)
