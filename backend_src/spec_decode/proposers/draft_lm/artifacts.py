"""Where ``make draft`` puts the distilled draft LM, and how ``draft_model_path`` resolves to a draft's folder."""

from __future__ import annotations

from pathlib import Path

from ...engine.model_loading import DEFAULT_MODEL_NAME, cache_dir, resolve_model_path

REPORT_FILE = "train_draft.json"  # the training report of make draft: its presence marks a finished draft


def default_draft_dir() -> Path:
    """Folder of the distilled default draft (``make draft``; may not exist yet)."""
    return cache_dir() / "models" / f"{DEFAULT_MODEL_NAME}-draft"


def default_draft_ready() -> bool:
    """True when ``make draft`` finished (the folder holds config.json and its train_draft.json report)."""
    d = default_draft_dir()
    return (d / "config.json").exists() and (d / REPORT_FILE).exists()


def resolve_draft_path(value: str | None) -> Path | None:
    """Map draft_model_path to a folder: ``auto`` -> the distilled default draft when it exists (else None, so the
    server serves model-free proposers), otherwise as :func:`resolve_model_path`.

    Raises:
        FileNotFoundError: a given path does not exist.
    """
    if value is not None and value.strip().lower() == "auto":
        return default_draft_dir() if default_draft_ready() else None
    return resolve_model_path(value)


def draft_lm_configured(value: str) -> bool:
    """Whether draft_model_path ``value`` names a draft LM (as :func:`resolve_draft_path` would find one), without
    loading or converting anything: ``auto`` when the distilled default draft exists; ``""``/``none``: no."""
    v = (value or "").strip().lower()
    if v == "auto":
        return default_draft_ready()
    return v not in ("", "none")
