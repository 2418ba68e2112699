"""The public API on a Ray cluster: af.init, af.materialize(cluster, model, text), and the
operators on cluster refs, exact against recomputing from text."""

from __future__ import annotations

import pytest

import aaflow as af

CONTEXT = list(range(20, 20 + 90))
QUESTION = [5, 6, 7]


@pytest.fixture(scope="module")
def cluster(tiny_llama_dir):
    c = af.init(replicas={str(tiny_llama_dir): 2}, num_cpus=2, dtype="float32", kv_cache_bytes=8 * 2**20)
    yield c, str(tiny_llama_dir)
    c.shutdown()


def recompute(replica, ids, n=8):
    import ray

    return ray.get(replica.actor.generate_text.remote(ids, n, ignore_eos=True)).token_ids


def test_materialize_transfer_generate_equal_recompute(cluster):
    import ray
    import torch

    c, model = cluster
    a, b = c.replicas(model)
    kv = af.materialize(c, model, CONTEXT)
    assert kv.replica.name == a.name and kv.token_ids == tuple(CONTEXT)
    moved = af.transfer(kv, b)
    assert moved.replica.name == b.name
    assert torch.equal(ray.get(a.actor.export_tensor.remote(kv.id)), ray.get(b.actor.export_tensor.remote(moved.id)))
    out = af.generate(moved, QUESTION, max_new_tokens=8, ignore_eos=True)
    assert out.token_ids == recompute(b, CONTEXT + QUESTION)
    af.free(kv)
    af.free(moved)


def test_fork_compose_evict_free_on_a_replica(cluster):
    c, model = cluster
    kv = af.materialize(c, model, CONTEXT)
    x, y = af.fork(kv, 2)
    longer = af.materialize(c, model, CONTEXT + QUESTION)
    exact = af.compose(kv, longer)
    assert exact.exact and exact.token_ids == tuple(CONTEXT + QUESTION)
    question = af.materialize(c, model, QUESTION * 4)
    approx = af.compose(kv, question, mode="rerotate")
    assert not approx.exact and approx.fidelity.mode == "rerotate"
    af.evict(x)
    assert af.generate(x, QUESTION, 6, ignore_eos=True).token_ids == recompute(kv.replica, CONTEXT + QUESTION, 6)
    af.free(y)
    with pytest.raises(af.KVRefFreedError):
        af.generate(y, QUESTION, 4)
    for ref in (kv, x, longer, exact, question, approx):
        af.free(ref)


def test_compose_across_replicas_needs_a_transfer(cluster):
    c, model = cluster
    a, b = c.replicas(model)
    on_a, on_b = af.materialize(c, model, CONTEXT, replica=a), af.materialize(c, model, QUESTION, replica=b)
    with pytest.raises(af.KVLocationError, match="transfer one of them first"):
        af.compose(on_a, on_b, mode="rerotate")
    af.free(on_a)
    af.free(on_b)


def test_unserved_model(cluster):
    c, _ = cluster
    with pytest.raises(af.ModelMismatchError, match="serves no replica of 'nope'"):
        af.materialize(c, "nope", "hello")


def test_replica_side_errors_arrive_as_aaflow_errors_not_ray_wrappers(cluster):
    import ray

    c, model = cluster
    kv = af.materialize(c, model, CONTEXT)
    other = af.materialize(c, model, QUESTION * 4)
    with pytest.raises(af.KVComposeError, match="mode='rerotate'") as info:
        af.compose(kv, other)
    assert not isinstance(info.value, ray.exceptions.RayTaskError)
    af.free(kv)
    af.free(other)


def test_bad_operator_arguments_raise_clean_errors(cluster):
    import ray

    c, model = cluster
    kv = af.materialize(c, model, CONTEXT)
    with pytest.raises(ValueError, match="fork needs n >= 1") as info:
        af.fork(kv, 0)
    assert not isinstance(info.value, ray.exceptions.RayTaskError)
    question = af.materialize(c, model, QUESTION)
    with pytest.raises(af.KVComposeError, match=r"r must be a number in \[0, 1\], got 2"):
        af.compose(kv, question, mode="blend", r=2)
    af.free(question)
    with pytest.raises(af.KVLocationError, match="needs a replica handle"):
        af.transfer(kv, "smollm2-1")
    with pytest.raises(af.PromptError, match="outside the vocabulary"):
        af.materialize(c, model, [10**6])
    assert af.generate(kv, QUESTION, 4, ignore_eos=True).token_ids == recompute(kv.replica, CONTEXT + QUESTION, 4)
    af.free(kv)
