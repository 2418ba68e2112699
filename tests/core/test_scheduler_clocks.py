"""One scheduler, two clocks: a workflow run on Ray and predicted on the simulated clock issues the
same replica calls, in the same order, to the same replicas."""

from __future__ import annotations

import pytest

import aaflow as af
from aaflow.runtime import prompt_builders
from aaflow.runtime.backend import Backend
from aaflow.runtime.executor import workflow_agents
from aaflow.runtime.scheduler import Scheduler
from aaflow.runtime.sim_backend import SimBackend
from aaflow.costmodel.hardware import ComputeProfile, HardwareProfile, LinkProfile
from aaflow.costmodel.model_profile import ModelProfile
from tests.cluster_checks import assert_no_kv_left, fixed_length_chain


class Recording(Backend):
    """Another backend, with every call it is given written down as (replica, kind, sessions,
    prompt tokens): decoded token ids differ between clocks, their number does not."""

    def __init__(self, inner: Backend) -> None:
        self.inner, self.calls = inner, []

    def replicas(self):
        return self.inner.replicas()

    def now(self) -> float:
        return self.inner.now()

    def default_transport(self) -> str:
        return self.inner.default_transport()

    def submit(self, replica, call):
        sessions = tuple(sid.split("/", 1)[1] for sid in call.sessions)  # without the run id
        self.calls.append((replica, call.kind.name, sessions, call.tokens))
        return self.inner.submit(replica, call)

    def wait(self, tickets, num_returns, timeout_s):
        return self.inner.wait(tickets, num_returns, timeout_s)

    def result(self, ticket):
        return self.inner.result(ticket)


@pytest.fixture(scope="module")
def two_replicas(tiny_llama_dir):
    cluster = af.init(replicas={str(tiny_llama_dir): 2}, num_cpus=2, dtype="float32", kv_cache_bytes=8 * 2**20)
    yield cluster, str(tiny_llama_dir)
    cluster.shutdown()


def simulated(cluster, model: str) -> SimBackend:
    """The cluster's replicas on the simulated clock, timed by a hand-built profile."""
    compute = ComputeProfile(0.005, 1e-4, 1e-8, 0.02, 1e-4, 1e-7)
    hardware = HardwareProfile("test-box", False, "hand-built", 2e10, {"tiny": compute}, {"ray": LinkProfile(5e9)})
    profile = ModelProfile.from_folder("tiny", model, dtype="float32")
    return SimBackend([(r.name, r.model) for r in cluster.replicas()], hardware, {model: profile}, "ray", 0.002)


@pytest.mark.parametrize("strategy", ["text", "recompute"])
def test_a_chain_issues_the_same_calls_on_ray_and_on_the_simulated_clock(two_replicas, strategy):
    from aaflow.cluster.ray_backend import RayBackend

    cluster, model = two_replicas
    wf = fixed_length_chain(model)
    builders, eos, _ = prompt_builders({model})
    on_ray, on_sim = Recording(RayBackend(cluster)), Recording(simulated(cluster, model))
    for backend in (on_ray, on_sim):
        Scheduler(workflow_agents(wf, builders, strategy), backend, eos).run()
    kinds = [kind for _, kind, _, _ in on_ray.calls]
    assert {"OPEN", "PREFILL", "STEPS", "CLOSE"} <= set(kinds), kinds  # a lone agent decodes in groups of steps
    assert on_sim.calls == on_ray.calls
    assert_no_kv_left(cluster)

