"""Hardware profiles: how long prefill, decode and KV moves take on a machine (seconds, bytes/s).

A profile is either *measured* (written by `aaflow calibrate` on the machine it describes) or a
*projection* from public figures (the shipped `aaflow/configs/hardware/*.yaml`, `measured: false`).
YAML only serializes the dataclasses; unknown keys are rejected, units are in the key names.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path

import yaml

from aaflow.common.errors import CostModelError
from aaflow.configs import CONFIG_DIR
from aaflow.costmodel.model_profile import ModelProfile
from aaflow.costmodel.units import parse_bandwidth, parse_duration
from aaflow.costmodel.yaml_fields import checked_keys, numbers

DERIVED_PREFILL_MIN_FIXED_S = 1e-4  # launch overhead of one derived prefill call


def _check_non_negative(owner: str, obj) -> None:
    for f in fields(obj):
        value = getattr(obj, f.name)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            if not math.isfinite(value) or value < 0:
                raise CostModelError(f"{owner}: {f.name} must be finite and non-negative, got {value!r}")


@dataclass(frozen=True)
class ComputeProfile:
    """Time of one model's prefill and decode on one replica (seconds)."""

    prefill_fixed_s: float  # per prefill call
    prefill_s_per_token: float  # linear term per new token
    prefill_s_per_token_ctx: float  # attention term: per new token per token attended (context before it)
    decode_fixed_s: float  # per batched decode step
    decode_s_per_seq: float  # per sequence in the batch
    decode_s_per_seq_ctx: float  # per sequence per context token
    prefill_s_per_member: float = 0.0  # per extra sequence packed into one prefill pass (its own attention calls)

    def __post_init__(self) -> None:
        _check_non_negative("ComputeProfile", self)

    def prefill_time(self, new_tokens: int, context_tokens: int = 0) -> float:
        """One prefill call of `new_tokens` after `context_tokens` already cached (0 s for no tokens)."""
        if new_tokens <= 0:
            return 0.0
        n = new_tokens
        return (self.prefill_fixed_s + self.prefill_s_per_token * n
                + self.prefill_s_per_token_ctx * n * (context_tokens + (n - 1) / 2))

    def decode_step_time(self, batch: int = 1, context_tokens: int = 0) -> float:
        """One batched decode step of `batch` sequences with `context_tokens` cached each (mean)."""
        return self.decode_fixed_s + batch * (self.decode_s_per_seq + self.decode_s_per_seq_ctx * context_tokens)

    def decode_time(self, steps: int, batch: int = 1, context_tokens: int = 0) -> float:
        """`steps` decode steps, the first with `context_tokens` cached, each step one more (closed form)."""
        if steps <= 0:
            return 0.0
        mean_context = context_tokens + (steps - 1) / 2
        return steps * self.decode_step_time(batch, 0) + batch * self.decode_s_per_seq_ctx * steps * mean_context

    def chunked_prefill_time(self, new_tokens: int, context_tokens: int, chunk_tokens: int) -> float:
        """Prefill of `new_tokens` in consecutive calls of `chunk_tokens` (the last one partial). The attention
        terms add up to the one-pass value, so chunking costs one fixed term per extra call."""
        if new_tokens <= 0:
            return 0.0
        if chunk_tokens <= 0:
            raise CostModelError(f"chunk_tokens must be positive, got {chunk_tokens!r}")
        calls = -(-new_tokens // chunk_tokens)
        return self.prefill_time(new_tokens, context_tokens) + (calls - 1) * self.prefill_fixed_s

    def scaled(self, factor: float, decode_factor: float | None = None) -> "ComputeProfile":
        """Prefill terms multiplied by `factor` and decode terms by `decode_factor` (default:
        `factor`), both > 0: the same replica running slower or faster, as a shared machine drifts."""
        decode_factor = factor if decode_factor is None else decode_factor
        for name, f in (("factor", factor), ("decode_factor", decode_factor)):
            if not (math.isfinite(f) and f > 0):
                raise CostModelError(f"ComputeProfile.scaled: {name} must be positive and finite, got {f!r}")
        return ComputeProfile(*(getattr(self, f.name) * (decode_factor if f.name.startswith("decode") else factor)
                                for f in fields(self)))

    @property
    def prefill_tokens_per_s(self) -> float:
        """Prefill throughput at 1024 new tokens and no context."""
        return 1024 / self.prefill_time(1024)


@dataclass(frozen=True)
class LinkProfile:
    """A transport between two replicas: bandwidth (bytes/s) and per-transfer latency (s).

    `in_place`: the transport reads the KV where it lies in the source's pool (NIXL scatter lists);
    otherwise the source first copies it out at memcpy speed (`source_copy_time`)."""

    bandwidth_bytes_per_s: float
    latency_s: float = 0.0
    in_place: bool = False

    def __post_init__(self) -> None:
        if not self.bandwidth_bytes_per_s > 0:  # inf is allowed: a link that costs only its latency
            raise CostModelError(f"LinkProfile: bandwidth_bytes_per_s must be > 0, got {self.bandwidth_bytes_per_s!r}")
        if not (math.isfinite(self.latency_s) and self.latency_s >= 0):
            raise CostModelError(f"LinkProfile: latency_s must be finite and non-negative, got {self.latency_s!r}")

    def transfer_time(self, nbytes: int) -> float:
        """Seconds to move `nbytes` in one transfer."""
        return self.latency_s + nbytes / self.bandwidth_bytes_per_s

    def source_copy_time(self, nbytes: int, memcpy_bytes_per_s: float) -> float:
        """Seconds the source spends copying `nbytes` out of its pool before the link moves them."""
        return 0.0 if self.in_place else nbytes / memcpy_bytes_per_s


def link_fields(d: dict, where: str) -> LinkProfile:
    """A link from YAML: numbers with units, `in_place` a boolean."""
    d = dict(d)
    in_place = d.pop("in_place", False)
    if not isinstance(in_place, bool):
        raise CostModelError(f"{where}: in_place must be true or false, got {in_place!r}")
    return LinkProfile(**numbers(d, where), in_place=in_place)


@dataclass(frozen=True)
class HardwareProfile:
    """Timings of one machine (one replica per device) and of the links between replicas."""

    name: str
    measured: bool  # True: calibrated on the machine it describes; False: public figures (projection)
    source: str  # citations / how measured
    memcpy_bytes_per_s: float
    compute: dict[str, ComputeProfile] = field(default_factory=dict)  # per model name
    links: dict[str, LinkProfile] = field(default_factory=dict)  # per transport name ("ray", "nvlink", ...)
    peak_flops: float | None = None  # per device, dense bf16 FLOP/s (for models without a compute entry)
    mfu: float = 0.5  # fraction of peak reached by prefill
    memory_bytes_per_s: float | None = None  # HBM/DRAM bandwidth (decode of unlisted models)
    call_overhead_s: float = 0.0  # fixed cost of one replica call (RPC), measured by `aaflow calibrate`
    concurrency_slowdown: float = 1.0  # compute runs this many times slower while another replica computes
    # on the same machine (shared cores, memory bandwidth); 1.0 for replicas on separate devices
    lent_core_speedup: float = 1.0  # a long prefill runs this many times faster on the cores of the idle
    # replicas of its machine (`aaflow.runtime.core_lending`); 1.0 where nothing is lent (one device each)

    def __post_init__(self) -> None:
        if not (math.isfinite(self.memcpy_bytes_per_s) and self.memcpy_bytes_per_s > 0):
            raise CostModelError(f"hardware {self.name!r}: memcpy_bytes_per_s must be positive, "
                                 f"got {self.memcpy_bytes_per_s!r}")
        if not (math.isfinite(self.concurrency_slowdown) and self.concurrency_slowdown >= 1):
            raise CostModelError(f"hardware {self.name!r}: concurrency_slowdown must be >= 1, "
                                 f"got {self.concurrency_slowdown!r}")
        if not (math.isfinite(self.lent_core_speedup) and self.lent_core_speedup >= 1):
            raise CostModelError(f"hardware {self.name!r}: lent_core_speedup must be >= 1, "
                                 f"got {self.lent_core_speedup!r}")
        if not (math.isfinite(self.call_overhead_s) and self.call_overhead_s >= 0):
            raise CostModelError(f"hardware {self.name!r}: call_overhead_s must be >= 0, got {self.call_overhead_s!r}")
        if not 0 < self.mfu <= 1:
            raise CostModelError(f"hardware {self.name!r}: mfu must be in (0, 1], got {self.mfu!r}")
        for key in ("peak_flops", "memory_bytes_per_s"):
            value = getattr(self, key)
            if value is not None and not (math.isfinite(value) and value > 0):
                raise CostModelError(f"hardware {self.name!r}: {key} must be positive or null, got {value!r}")

    def compute_for(self, model: ModelProfile) -> ComputeProfile:
        """The listed compute entry of `model.name`, else one derived from peak FLOP/s (prefill, at `mfu`)
        and memory bandwidth (decode reads all weights per step and each sequence's KV)."""
        if model.name in self.compute:
            return self.compute[model.name]
        missing = [k for k in ("peak_flops", "memory_bytes_per_s") if getattr(self, k) is None]
        if missing:
            raise CostModelError(
                f"hardware {self.name!r} has no compute entry for model {model.name!r} (has {sorted(self.compute)}) "
                f"and no {' / '.join(missing)} to derive one; run `aaflow calibrate` with this model")
        flops_per_s = self.peak_flops * self.mfu
        weights_s = model.weight_bytes / self.memory_bytes_per_s
        return ComputeProfile(
            prefill_fixed_s=max(weights_s, DERIVED_PREFILL_MIN_FIXED_S),
            prefill_s_per_token=model.flops_per_token / flops_per_s,
            prefill_s_per_token_ctx=model.attention_flops_per_token_per_context_token / flops_per_s,
            decode_fixed_s=weights_s,
            decode_s_per_seq=model.flops_per_token / self.peak_flops,
            decode_s_per_seq_ctx=model.kv_bytes_per_token / self.memory_bytes_per_s,
        )

    def link(self, name_or_bandwidth: str) -> LinkProfile:
        """A named link of this profile, or one given as "25Gbps" / "25Gbps,10us" (latency default 0)."""
        if name_or_bandwidth in self.links:
            return self.links[name_or_bandwidth]
        bandwidth, _, latency = str(name_or_bandwidth).partition(",")
        try:
            return LinkProfile(parse_bandwidth(bandwidth.strip()), parse_duration(latency.strip() or 0))
        except CostModelError as exc:
            raise CostModelError(f"hardware {self.name!r}: {name_or_bandwidth!r} is neither a link of "
                                 f"{sorted(self.links)} nor 'BANDWIDTH[,LATENCY]' ({exc})") from None

    def with_compute_scaled(self, factors: dict[str, float],
                            decode_factors: dict[str, float] | None = None) -> "HardwareProfile":
        """A copy whose compute entries named in `factors` are scaled (see `ComputeProfile.scaled`;
        decode terms by `decode_factors` where it names the entry)."""
        decode_factors = decode_factors or {}
        return replace(self, compute={k: c.scaled(factors[k], decode_factors.get(k)) if k in factors else c
                                      for k, c in self.compute.items()})

    def with_link(self, name: str, link: LinkProfile) -> "HardwareProfile":
        """A copy with `link` added (or replaced) under `name`."""
        return replace(self, links={**self.links, name: link})

    def to_dict(self) -> dict:
        """Plain data for YAML (units in the key names)."""
        d = asdict(self)
        d["compute"] = {k: asdict(v) for k, v in self.compute.items()}
        d["links"] = {k: asdict(v) for k, v in self.links.items()}
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "HardwareProfile":
        """Build from plain data; unknown or missing keys raise CostModelError naming them."""
        d = checked_keys(d, cls, "hardware profile")
        name = str(d["name"])
        if not isinstance(d["measured"], bool):
            raise CostModelError(f"hardware {name!r}: measured must be true or false, got {d['measured']!r}")
        compute = {str(m): ComputeProfile(**numbers(checked_keys(c, ComputeProfile, f"{name}.compute.{m}"),
                                                     f"{name}.compute.{m}"))
                   for m, c in (d.get("compute") or {}).items()}
        links = {str(k): link_fields(checked_keys(v, LinkProfile, f"{name}.links.{k}"), f"{name}.links.{k}")
                 for k, v in (d.get("links") or {}).items()}
        scalars = {k: v for k, v in d.items() if k not in ("name", "measured", "source", "compute", "links")}
        return cls(name=name, measured=d["measured"], source=str(d.get("source", "")), compute=compute,
                   links=links, **numbers(scalars, name))

    def save(self, path) -> None:
        """Write this profile as YAML."""
        Path(path).write_text(yaml.safe_dump(self.to_dict(), sort_keys=False, allow_unicode=True))

    @classmethod
    def load(cls, path) -> "HardwareProfile":
        """Read a profile from a YAML file."""
        path = Path(path)
        try:
            data = yaml.safe_load(path.read_text())
        except OSError as exc:
            raise CostModelError(f"cannot read hardware profile {path}: {exc}") from None
        except yaml.YAMLError as exc:
            raise CostModelError(f"hardware profile {path} is not valid YAML: {exc}") from None
        try:
            return cls.from_dict(data)
        except CostModelError as exc:
            raise CostModelError(f"{path}: {exc}") from None


def hardware_dir() -> Path:
    """The folder of the shipped hardware profiles (`aaflow/configs/hardware`)."""
    return CONFIG_DIR / "hardware"


def available_hardware() -> list[str]:
    """Names of the shipped hardware profiles."""
    return sorted(p.stem for p in hardware_dir().glob("*.yaml"))


def load_hardware(name_or_path: str) -> HardwareProfile:
    """A hardware profile from a YAML path, or a shipped one by name (`aaflow/configs/hardware/<name>.yaml`)."""
    path = Path(name_or_path)
    if path.suffix in (".yaml", ".yml") or path.is_file():
        if not path.is_file():
            raise CostModelError(f"hardware profile file {path} does not exist")
        return HardwareProfile.load(path)
    shipped = hardware_dir() / f"{name_or_path}.yaml"
    if not shipped.is_file():
        raise CostModelError(f"unknown hardware profile {name_or_path!r}; available: {available_hardware()} "
                             "(or pass a path to a YAML written by `aaflow calibrate`)")
    return HardwareProfile.load(shipped)
