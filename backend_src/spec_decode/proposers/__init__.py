"""The proposers: cheap guesses of the next k tokens, behind one batched contract and one registry.

Like vLLM's ``get_spec_proposals`` and transformers' candidate generators: a proposer takes a round's sequences
(:class:`ProposalRequest`) and returns one ``Proposal(draft_token_ids [k'] int64, draft_probs [k', V] float32 or
None)`` per sequence, k' <= k.

- :mod:`.base`: the contract, :class:`Proposer` (CONTRIBUTING.md walks through adding one).
- :mod:`.registry`: the served proposers by ``speculative_method`` name.
- :mod:`.ngram`, :mod:`.hybrid`; the subpackages :mod:`.suffix`, :mod:`.draft_lm`, :mod:`.eagle`: the proposers.
- :mod:`.speculators`: published speculator checkpoints (EAGLE, EAGLE-3, Medusa, MLP speculator, Arctic's): their
  detection, loading and the heads' proposers.

How k changes from step to step is :mod:`spec_decode.scheduler.k_schedule`.
"""

from .base import Proposal, ProposalRequest, Proposer
from .draft_lm import DraftLMSettings, DraftModelProposer
from .eagle import Eagle3Head, Eagle3Proposer, EagleHead, EagleProposer
from .hybrid import HybridProposer, HybridSettings
from .ngram import NgramProposer, NgramSettings
from .registry import METHODS, NO_SPECULATION, PROPOSERS, build_proposers, k_schedule, offered_methods
from .suffix import SuffixProposer, SuffixSettings

__all__ = ["METHODS", "NO_SPECULATION", "PROPOSERS", "DraftLMSettings", "DraftModelProposer", "Eagle3Head",
           "Eagle3Proposer", "EagleHead", "EagleProposer", "HybridProposer", "HybridSettings", "NgramProposer",
           "NgramSettings", "Proposal", "ProposalRequest", "Proposer", "SuffixProposer", "SuffixSettings",
           "build_proposers", "k_schedule", "offered_methods"]
