"""Proposers: cheap guesses of the next k tokens, behind one protocol (:class:`Proposer`).

Like transformers' candidate generators and vLLM's ``SpeculativeProposals``: every proposer returns
``Proposal(draft_token_ids [k'], draft_probs [k', V] or None)`` with k' <= k.
"""

from .base import Proposal, Proposer
from .draft_lm import DraftModelProposer
from .hybrid import HybridProposer
from .ngram import NgramProposer
from .suffix import SuffixProposer

__all__ = ["Proposal", "Proposer", "DraftModelProposer", "HybridProposer", "NgramProposer", "SuffixProposer"]
