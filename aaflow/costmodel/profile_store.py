"""This machine's calibrated hardware profiles: their names, where they are kept and how they are
found (`aaflow calibrate` writes them; `aaflow.cluster.calibration.ensure_profile` calibrates on first use).
$AAFLOW_HARDWARE_PROFILE, a profile's YAML path, overrides the machine's own: a deployment whose
replicas sit on other hosts than the machine it was calibrated on (its links measured there) plans
with the profile measured on that deployment.
A compute entry is keyed by `model_key` (model, dtype, threads): profiles of other settings differ.
"""

from __future__ import annotations

import functools
import os
import re
import socket
from dataclasses import replace
from pathlib import Path

from aaflow.common.errors import CostModelError
from aaflow.common.machine import cpu_kind
from aaflow.models.registry import cache_dir
from aaflow.costmodel.hardware import HardwareProfile, hardware_dir


def default_profile_name() -> str:
    """This machine's profile name: `local-<hostname>-<cpu kind>` (see `aaflow.common.machine.cpu_kind`):
    machines that share a hostname but not a CPU kind do not share a profile."""
    return "local-" + re.sub(r"[^A-Za-z0-9_.-]", "-", f"{socket.gethostname()}-{cpu_kind()}")


def cached_profile_path(name: str) -> Path:
    """Where a profile calibrated on first use is kept: the user's aaflow cache."""
    return cache_dir() / "hardware" / f"{name}.yaml"


def model_key(info: dict) -> str:
    """The compute-entry key of a replica: model, dtype and threads (or the vLLM engine) change its speed."""
    speed = "vllm" if info.get("engine") == "vllm" else f"{info['threads']}t"
    return f"{Path(info['model']).name}|{info['dtype']}|{speed}"


PROFILE_ENV = "AAFLOW_HARDWARE_PROFILE"


def find_profile(name: str | None = None) -> HardwareProfile | None:
    """The calibrated profile of this machine, or None: `aaflow calibrate`'s (project configs),
    completed by the entries calibrated on first use (the cache) for models it lacks. Without a
    `name`, the file $AAFLOW_HARDWARE_PROFILE names wins, alone (`CostModelError` if it is missing)."""
    if name is None and os.environ.get(PROFILE_ENV):
        path = Path(os.environ[PROFILE_ENV]).expanduser()
        if not path.is_file():
            raise CostModelError(f"${PROFILE_ENV} names {path}, which is not a file: point it at a profile "
                                 "written by `aaflow calibrate`, or unset it to use this machine's")
        return _load(path)
    name = name or default_profile_name()
    found = [_load(p) for p in (hardware_dir() / f"{name}.yaml", cached_profile_path(name)) if p.exists()]
    if not found:
        return None
    profile = found[0]
    for extra in found[1:]:
        profile = replace(profile, compute={**extra.compute, **profile.compute},
                          links={**extra.links, **profile.links})
    return profile


def _load(path: Path) -> HardwareProfile:
    """`HardwareProfile.load`, memoized by the file's modification time and size (a profile is
    immutable; `af.run(strategy="auto")` looks it up on every run, which should not parse the YAML
    each time)."""
    stat = path.stat()
    return _load_version(str(path), stat.st_mtime_ns, stat.st_size)


@functools.lru_cache(maxsize=8)
def _load_version(path: str, mtime_ns: int, size: int) -> HardwareProfile:
    return HardwareProfile.load(path)


def covers(profile: HardwareProfile | None, infos: dict[str, dict]) -> bool:
    """Whether `profile` has a compute entry for every replica described in `infos` and a link."""
    return profile is not None and {model_key(i) for i in infos.values()} <= set(profile.compute) \
        and bool(profile.links)
