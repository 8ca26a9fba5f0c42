"""n-gram prompt lookup (Saxena 2023, "Prompt Lookup Decoding"; vLLM ``NGramWorker``).

Match the last n tokens of the sequence (n from ``ngram_max`` down to ``ngram_min``) against earlier positions of the
same sequence and propose the k tokens that followed the most recent match. No draft probabilities; stateless, so there
is nothing to cache or free per sequence.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ..settings import ConfigSettings, InvalidInputError, in_range
from .base import Proposal, ProposalRequest, Proposer


@dataclass(frozen=True)
class NgramSettings(ConfigSettings):
    """Config parameters ``ngram_min`` and ``ngram_max``: the n-gram lengths matched, 1 <= min <= max."""

    PREFIX = "ngram_"
    min: int = 1
    max: int = 4

    def check(self) -> None:
        """min >= 1 and max >= min."""
        in_range("min", self.min, 1)
        if self.max < self.min:
            raise InvalidInputError("max", f"must be >= ngram_min={self.min}, got {self.max}")


class NgramProposer(Proposer):
    """Prompt-lookup proposer (``speculative_method=ngram``).

    Args:
        settings: the n-gram lengths (default 1..4).
    """

    name = "ngram"
    Settings = NgramSettings

    def __init__(self, settings: NgramSettings | None = None):
        settings = settings or NgramSettings()
        self.min_n, self.max_n = settings.min, settings.max

    def propose(self, requests: list[ProposalRequest]) -> list[Proposal]:
        """Per request, up to ``k`` tokens copied from after the most recent earlier match of the sequence's tail
        (k' may be below k near the end of the sequence, or 0), without draft probabilities."""
        return [self._one(r.token_ids, r.k) for r in requests]

    def _one(self, token_ids: list[int], k: int) -> Proposal:
        ids = np.asarray(token_ids, dtype=np.int64)
        n_tok = len(ids)
        if n_tok < 2:
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
