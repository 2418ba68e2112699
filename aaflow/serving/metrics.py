"""The endpoint's Prometheus metrics (`/metrics`), in a registry of its own."""

from __future__ import annotations

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest

LATENCY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 25, 60, 120, 300)


class ServingMetrics:
    """Requests, tokens (prompt, of them cached, generated), latency, time to first token, and
    requests refused for their API key."""

    content_type = CONTENT_TYPE_LATEST

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter("aaflow_requests", "Requests answered", registry=self.registry)
        self.cancels = Counter("aaflow_requests_cancelled", "Streams whose client went away", registry=self.registry)
        self.auth_failures = Counter("aaflow_auth_failures", "Requests refused for a missing or wrong API key",
                                     registry=self.registry)
        self.prompt = Counter("aaflow_prompt_tokens", "Prompt tokens", registry=self.registry)
        self.cached = Counter("aaflow_cached_prompt_tokens", "Prompt tokens served from KV already there",
                              registry=self.registry)
        self.generated = Counter("aaflow_generation_tokens", "Tokens generated", registry=self.registry)
        self.latency = Histogram("aaflow_request_latency_seconds", "Request to last token", buckets=LATENCY_BUCKETS,
                                 registry=self.registry)
        self.ttft = Histogram("aaflow_time_to_first_token_seconds", "Request to first streamed token",
                              buckets=LATENCY_BUCKETS, registry=self.registry)

    def finished(self, answer, latency_s: float, first_token_s: float | None = None) -> None:
        """A request's agent (`AgentResult`) answered after `latency_s`."""
        self.requests.inc()
        self.prompt.inc(answer.prompt_tokens)
        self.cached.inc(answer.prefill_reused)
        self.generated.inc(len(answer.token_ids))
        self.latency.observe(latency_s)
        if first_token_s is not None:
            self.ttft.observe(first_token_s)

    def cancelled(self) -> None:
        self.cancels.inc()

    def exposition(self) -> bytes:
        return generate_latest(self.registry)
