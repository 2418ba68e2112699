"""This machine's CPU: its model name, and the kind that a measured hardware profile holds for."""

from __future__ import annotations

import platform

import torch


def cpu_model() -> str:
    """The CPU's model name as the OS reports it (`platform.processor()` where /proc/cpuinfo is absent)."""
    return _cpuinfo_field("model name") or platform.processor()


def cpu_kind() -> str:
    """The CPU's vendor and the widest matrix instructions torch uses on it: `intel-amx`,
    `amd-avx512bf16`, `intel-avx512`, ... Compute speed differs between kinds far more than
    between machines of one kind, so a measured profile is named for its kind (SmolLM2-135M
    prefill per token on one thread, by kind: docs/RESULTS-history.md)."""
    vendor = cpu_vendor()
    isa = matrix_isa()
    return f"{vendor}-{isa}" if isa else vendor


def cpu_vendor() -> str:
    """"intel", "amd", or the machine's architecture name for other CPUs."""
    return {"GenuineIntel": "intel", "AuthenticAMD": "amd"}.get(_cpuinfo_field("vendor_id"), platform.machine())


def matrix_isa() -> str | None:
    """The widest matrix instructions torch uses here: "amx", "avx512bf16", "avx512", "avx2", or None."""
    checks = (("amx", torch.cpu._is_amx_tile_supported), ("avx512bf16", torch.cpu._is_avx512_bf16_supported),
              ("avx512", torch.cpu._is_avx512_supported), ("avx2", torch.cpu._is_avx2_supported))
    return next((name for name, supported in checks if supported()), None)


def _cpuinfo_field(name: str) -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line.split(":", 1)[1].strip() for line in f if line.split(":")[0].strip() == name), "")
    except OSError:
        return ""
