"""C++ kernels under `csrc/`, compiled on first use with the machine's compiler.

Each source is built once per machine (torch's cpp_extension, about 30 s, cached under
TORCH_EXTENSIONS_DIR or ~/.cache/torch_extensions) with `-march=native`, so the code uses the
vector instructions of the CPU it runs on. Without a compiler, or with its environment switch set
to 0, `load` answers None and the engine keeps its torch paths."""

from __future__ import annotations

import hashlib
import logging
import os
import platform
import sys
import threading
from contextlib import nullcontext
from pathlib import Path

from torch.utils.cpp_extension import _get_build_directory  # private: only for the progress line
from torch.utils.cpp_extension import load as load_extension

from aaflow.common.progress import timed

log = logging.getLogger(__name__)

CSRC = Path(__file__).parent / "csrc"
BUILD_S = 30  # about how long one source takes to compile (for the progress bar)


class NativeModule:
    """One C++ source, built and loaded at most once per process (thread-safe)."""

    def __init__(self, source: str, label: str, env_switch: str, extra_cflags: tuple[str, ...] = ()) -> None:
        self.source = CSRC / source
        self.extra_cflags = list(extra_cflags)  # beyond -O3 -march=native -fopenmp
        self.label = label  # for the progress line: "the bf16 decode attention kernel"
        self.env_switch = env_switch  # set to 0: not built, not loaded
        self._lock = threading.Lock()
        self._module = None
        self._tried = False

    def load(self):
        """The compiled module, building it on the first call; None where it cannot be built or is
        switched off."""
        if os.environ.get(self.env_switch, "1") == "0":
            return None
        with self._lock:
            if self._tried:
                return self._module
            self._tried = True
            try:
                name = self._build_name()
                building = not _is_built(name)
                if building:
                    print(f"aaflow: building {self.label}, once for this machine (about {BUILD_S} s) ...",
                          file=sys.stderr, flush=True)
                with timed(f"building {self.label}", BUILD_S) if building else nullcontext():
                    self._module = load_extension(
                        name, sources=[str(self.source)], verbose=False,
                        extra_cflags=["-O3", "-march=native", "-fopenmp", *self.extra_cflags],
                        extra_ldflags=["-fopenmp"])
            except Exception as error:  # no compiler, no headers: the torch paths still work
                log.warning("aaflow: %s unavailable, using torch paths: %s", self.label, error)
                self._module = None
            return self._module

    def _build_name(self) -> str:
        """One build per source text and CPU: the code is compiled for the machine it runs on."""
        cpu = ""
        try:
            cpu = next((line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags")), "")
        except OSError:
            pass
        code = self.source.read_bytes() + b"".join(h.read_bytes() for h in sorted(CSRC.glob("*.h")))  # headers too
        code += " ".join(self.extra_cflags).encode()
        digest = hashlib.sha256(code + platform.machine().encode() + cpu.encode()).hexdigest()[:12]
        return f"aaflow_{self.source.stem}_{digest}"


def _is_built(name: str) -> bool:
    try:
        return (Path(_get_build_directory(name, verbose=False)) / f"{name}.so").exists()
    except Exception:
        return False
