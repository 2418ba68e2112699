"""YAML configuration shipped with aaflow: model registry, hardware profiles, workflows. Layer: core."""

from pathlib import Path

CONFIG_DIR = Path(__file__).resolve().parent
