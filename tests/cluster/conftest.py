"""Fixtures shared by test modules of this folder."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def model(tiny_llama_dir):
    """The tiny Llama's folder as a model name (test_deployment.py, test_deployment_readme.py)."""
    return str(tiny_llama_dir)
