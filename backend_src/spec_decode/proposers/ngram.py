"""n-gram prompt lookup (Saxena 2023, "Prompt Lookup Decoding"; vLLM ``NGramWorker``).

Match the last n tokens of the sequence (n from ``max_n`` down to ``min_n``) against earlier positions of the same
sequence and propose the k tokens that followed the most recent match. No draft probabilities; stateless, so there is
nothing to cache or free per sequence.
"""

from __future__ import annotations

import numpy as np
import torch

from ..sampling import SamplingParams
from .base import Proposal


class NgramProposer:
    """Prompt-lookup proposer.

    Args:
        min_n: shortest n-gram to match (>= 1).
        max_n: longest n-gram to match (>= min_n).

    Raises:
        ValueError: invalid n range.
    """

    def __init__(self, min_n: int = 1, max_n: int = 4):
        if not 1 <= min_n <= max_n:
            raise ValueError(f"need 1 <= min_n <= max_n, got min_n={min_n}, max_n={max_n}")
        self.min_n, self.max_n = min_n, max_n

    def propose(self, seq_id: int, token_ids: list[int], k: int, params: SamplingParams, step: int) -> Proposal:
        """Propose up to ``k`` tokens copied from after the most recent earlier match of the sequence's tail.

        Returns a :class:`Proposal` with ``draft_probs=None`` (k' may be below k near the end of the sequence, or 0).
        """
        ids = np.asarray(token_ids, dtype=np.int64)
        n_tok = len(ids)
        if k <= 0 or n_tok < 2:
            return Proposal.empty()
        for n in range(min(self.max_n, n_tok - 1), self.min_n - 1, -1):
            tail = ids[n_tok - n :]
            # windows[i] = ids[i : i + n] for every start i whose window ends before the tail itself starts.
            windows = np.lib.stride_tricks.sliding_window_view(ids[: n_tok - 1], n)
            hits = np.nonzero((windows == tail).all(axis=1))[0]
            if len(hits):
                start = int(hits[-1]) + n
                draft = ids[start : start + k]
                if len(draft):
                    return Proposal(torch.from_numpy(draft.copy()), None)
        return Proposal.empty()

    def release(self, seq_id: int) -> None:
        """Stateless: nothing to free."""
