"""Where ``make speculator`` puts the EAGLE-3 head it trains (``speculator_path: auto`` serves it from there)."""

from __future__ import annotations

from pathlib import Path

from ...engine.model_loading import DEFAULT_MODEL_NAME, cache_dir

REPORT_FILE = "train_speculator.json"  # the training report of make speculator: its presence marks a finished head


def default_eagle_dir() -> Path:
    """Folder of the head ``make speculator`` trains for the embedded target (may not exist yet)."""
    return cache_dir() / "models" / f"{DEFAULT_MODEL_NAME}-eagle"
