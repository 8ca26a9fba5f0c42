"""Helpers shared by the unit tests."""

import numpy as np


def step_row(seq, ids, drafts=(), **kw) -> dict:
    """One sequence's row of a step model's request (greedy; overrides as keyword arguments)."""
    base = {"sequence_id": np.array([seq], np.uint64), "token_ids": np.array(ids, np.int64),
            "draft_token_ids": np.array(drafts, np.int64), "temperature": np.array([0.0], np.float32),
            "top_k": np.array([0], np.int32), "top_p": np.array([1.0], np.float32), "release": np.array([False]),
            "random_seed": np.array([0], np.int64), "step": np.array([0], np.int64)}
    base.update({k: np.array([v]) if not isinstance(v, np.ndarray) else v for k, v in kw.items()})
    return base
