"""A vLLM engine kept loaded in a subprocess of `.venv-vllm`'s python, spoken to in JSON lines.

The benchmark runners (`vllm_runner.VllmRunner`, `vllm_serve_runner.VllmServeRunner`) send one JSON
message per line on its stdin and read answers as stdout lines with a known prefix; its stderr's
tail goes into every error. The subprocess runs in a session of its own so that a timeout kills
vLLM's engine-core and worker processes too (they hold the pipes open and would keep spinning on
the cores).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
from pathlib import Path

VLLM_PYTHON = Path(__file__).resolve().parents[2] / ".venv-vllm" / "bin" / "python"


class VllmError(RuntimeError):
    """vLLM failed to start, died, or did not answer in time; the message holds its stderr's tail."""


class VllmSubprocess:
    """`script` run by `.venv-vllm`'s python, answering within `timeout_s` per message; `label`
    names it in errors. A context manager: leaving it closes the engine."""

    def __init__(self, script: str, label: str, timeout_s: float) -> None:
        self.label, self.timeout_s = label, timeout_s
        self.proc = subprocess.Popen([str(VLLM_PYTHON), "-c", script], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                     start_new_session=True)
        self._stderr: list[str] = []
        threading.Thread(target=self._drain_stderr, daemon=True).start()

    def close(self) -> None:
        """End the engine: stdin closed (it exits its loop), killed whole after 60 s."""
        if self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self._kill()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _send(self, message: dict) -> None:
        try:
            self.proc.stdin.write(json.dumps(message) + "\n")
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError) as exc:
            raise VllmError(f"{self.label} is gone: {self._tail()}") from exc

    def _answer(self, prefix: str) -> str:
        """The rest of the next stdout line starting with `prefix`, within the timeout."""
        timer = threading.Timer(self.timeout_s, self._kill)
        timer.start()
        try:
            for line in self.proc.stdout:
                if line.startswith(prefix):
                    return line[len(prefix):].strip()
        finally:
            timer.cancel()
        raise VllmError(f"{self.label} exited {self.proc.wait()} or timed out after {self.timeout_s:.0f} s: "
                        f"{self._tail()}")

    def _kill(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass

    def _drain_stderr(self) -> None:
        for line in self.proc.stderr:
            self._stderr = (self._stderr + [line])[-40:]

    def _tail(self) -> str:
        return "".join(self._stderr).strip()[-800:]
