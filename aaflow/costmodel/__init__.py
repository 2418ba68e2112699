"""The cost model: hardware and model profiles, their calibration fits, and the analytical price
of each edge strategy (transfer, stream, recompute). Knows nothing of Ray, the runtime or an engine. Layer: core."""
