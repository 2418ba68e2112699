"""Installed, the project is one package: `aaflow` (its layers are folders under it)."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_the_wheel_installs_exactly_one_top_level_package(tmp_path):
    source = tmp_path / "source"  # a copy: no build folder left in (or reused from) the checkout
    shutil.copytree(REPO, source, ignore=shutil.ignore_patterns(".venv*", ".git", "build", "dist", "*.egg-info",
                                                                "__pycache__", "docs", "results"))
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--quiet",
                    "-w", str(tmp_path), str(source)], check=True, capture_output=True, timeout=300)
    wheel, = tmp_path.glob("aaflow-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
        info = next(n for n in names if n.endswith(".dist-info/top_level.txt"))
        assert archive.read(info).decode().split() == ["aaflow"]
    tops = {n.split("/")[0] for n in names}
    assert tops == {"aaflow", info.split("/")[0]}, f"installed beside aaflow: {sorted(tops)}"
    for shipped in ("aaflow/configs/workflows/review.yaml", "aaflow/engine/csrc/", "aaflow/benchmarks/serve_bench.py",
                    "aaflow/cluster/deployment.py", "aaflow/operators/fork.py", "aaflow/costmodel/edge.py"):
        assert any(n.startswith(shipped) for n in names), f"{shipped} is not in the wheel"
