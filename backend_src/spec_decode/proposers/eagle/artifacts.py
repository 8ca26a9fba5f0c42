"""Where ``make speculator`` puts the EAGLE head, and how ``eagle_path`` resolves to a head's folder."""

from __future__ import annotations

from pathlib import Path

from ...engine.model_loading import DEFAULT_MODEL_NAME, cache_dir
from .model import CONFIG_FILE

REPORT_FILE = "train_speculator.json"  # the training report of make speculator: its presence marks a finished head


def default_eagle_dir() -> Path:
    """Folder of the head ``make speculator`` trains for the embedded target (may not exist yet)."""
    return cache_dir() / "models" / f"{DEFAULT_MODEL_NAME}-eagle"


def resolve_eagle_path(value: str) -> Path | None:
    """``auto`` -> the default head when ``make speculator`` has built it (else None); ``""``/``none`` -> None; else
    the folder.

    Raises:
        FileNotFoundError: a given folder without ``config.json``.
    """
    v = (value or "").strip()
    if v.lower() == "auto":
        d = default_eagle_dir()
        return d if (d / REPORT_FILE).exists() else None
    if v.lower() in ("", "none"):
        return None
    path = Path(v).expanduser()
    if not (path / CONFIG_FILE).exists():
        raise FileNotFoundError(f"EAGLE head folder {str(path)!r} has no {CONFIG_FILE}")
    return path
