"""Calibration microbenchmarks inside a vLLM replica, with the built-in replica's sample format.

Samples are what the executor sees through a session: a prefill is a request that returns its
first token (prefill plus one sampling step, the server round trip included); a context is
prefilled first by a request whose full blocks stay in vLLM's prefix cache, so that the timed
request computes only the new tokens. A decode step is one `next_tokens` over `batch` running
requests. The prefix cache is reset afterwards. Links use the built-in `calibrate_receive`.
"""

from __future__ import annotations

import statistics
import time

from aaflow.engine.sampling import SamplingParams
from aaflow.cluster.replica_microbench import QUICK_DECODE, Calibration


class VLLMCalibration(Calibration):
    """The microbenchmarks of a `VLLMReplica` (`replica.engine` is a `VLLMEngine`)."""

    def _fits(self, tokens: int, sequences: int = 1) -> bool:
        return tokens + 2 <= self.replica.info()["max_tokens"]  # room for the sampled tokens

    def _one_token(self, rid: str, ids: list[int], use_cache: bool) -> float:
        t0 = time.perf_counter()
        self.engine.start_request(rid, ids, SamplingParams(max_new_tokens=1, ignore_eos=True),
                                  use_prefix_cache=use_cache)
        try:
            self.engine.next_tokens([rid])
        finally:
            self.engine.abort_requests([rid])
        return time.perf_counter() - t0

    def _time_prefill(self, new: int, context: int, seed: int) -> float:
        rid = f"{self.replica.name}/calibrate/{seed}"
        if not context:
            return self._one_token(rid, self._random_ids(new, seed), use_cache=False)
        prefix = self._random_ids(context, seed + 1)
        self._one_token(rid + "/context", prefix, use_cache=True)  # leaves the context's blocks cached
        return self._one_token(rid, prefix + self._random_ids(new, seed), use_cache=True)

    def calibrate_packing(self, *args, **kwargs) -> list[tuple[int, int, int, float]]:
        """No samples: vLLM batches requests in its own scheduler, where a pack's members cost no extra call."""
        return []

    def calibrate_decode(self, points=QUICK_DECODE, steps: int = 12) -> list[tuple[int, int, float]]:
        """Seconds per `next_tokens` over `batch` running requests of `context` prompt tokens each."""
        samples = []
        for i, (batch, context) in enumerate(points):
            if not self._fits(context + steps + 1, batch):
                continue
            rids = [f"{self.replica.name}/calibrate-decode/{i}/{j}" for j in range(batch)]
            params = SamplingParams(max_new_tokens=steps + 2, ignore_eos=True)
            try:
                for j, rid in enumerate(rids):
                    self.engine.start_request(rid, self._random_ids(context, 1000 * i + j), params,
                                              use_prefix_cache=False)
                self.engine.next_tokens(rids)  # prefill and the first token: not a decode step
                times = []
                for _ in range(steps):
                    t0 = time.perf_counter()
                    self.engine.next_tokens(rids)
                    times.append(time.perf_counter() - t0)
                samples.append((batch, context, statistics.median(times)))
            finally:
                self.engine.abort_requests(rids)
        self.replica.clear_prefix_cache()
        return samples
