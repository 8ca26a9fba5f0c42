"""The draft LM proposer: a small causal LM with its own KV caches, and where ``make draft`` keeps the distilled one."""

from .artifacts import default_draft_dir, default_draft_ready, draft_lm_configured, resolve_draft_path
from .proposer import DraftLMSettings, DraftModelProposer

__all__ = ["DraftLMSettings", "DraftModelProposer", "default_draft_dir", "default_draft_ready", "draft_lm_configured",
           "resolve_draft_path"]
