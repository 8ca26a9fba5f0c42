"""Hybrid proposer (Arctic Inference): the suffix draft when its score reaches k, otherwise a model-based proposal.

The score of a suffix draft is the expected number of accepted tokens (sum of its running probabilities), so score >= k
means suffix matching expects to fill all k draft slots; otherwise the fallback proposer (the draft LM, or n-gram prompt
lookup where no draft model is configured) drafts this step. The request's suffix trie is updated every step either way.
"""

from __future__ import annotations

import torch

from ..sampling import SamplingParams
from .base import Proposal, Proposer
from .suffix import SuffixProposer


class HybridProposer:
    """Suffix decoding with a fallback proposer.

    Args:
        suffix: the suffix-decoding proposer (shared with speculative_method=suffix).
        fallback: the proposer used when the suffix score is below k.
    """

    def __init__(self, suffix: SuffixProposer, fallback: Proposer):
        self.suffix = suffix
        self.fallback = fallback

    def propose(self, seq_id: int, token_ids: list[int], k: int, params: SamplingParams, step: int) -> Proposal:
        """The suffix draft if its score >= k, else the fallback's proposal."""
        if k <= 0:
            return Proposal.empty()
        draft = self.suffix.speculate(seq_id, token_ids, k, self.suffix.uses_global_tree(params))
        if draft.score >= k:
            return Proposal(torch.tensor(draft.token_ids, dtype=torch.int64), None)
        return self.fallback.propose(seq_id, token_ids, k, params, step)

    def release(self, seq_id: int) -> None:
        """Free both proposers' state of ``seq_id`` (the suffix response joins the global trie)."""
        self.suffix.release(seq_id)
        self.fallback.release(seq_id)
