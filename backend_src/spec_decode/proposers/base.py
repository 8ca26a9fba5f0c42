"""The proposer protocol shared by the draft LM and the model-free proposers."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from ..sampling import SamplingParams


@dataclass
class Proposal:
    """Draft tokens for one sequence (vLLM ``SpeculativeProposals`` for a single row).

    Attributes:
        draft_token_ids: [k'] int64, k' <= k requested (k' may be 0: nothing to propose).
        draft_probs: [k', V] float32 distributions the drafts were sampled from, or None for proposers without
            probabilities (n-gram, suffix): the verifier then treats q as one-hot.
    """

    draft_token_ids: torch.Tensor
    draft_probs: torch.Tensor | None = None

    @staticmethod
    def empty() -> Proposal:
        """A proposal with no draft tokens."""
        return Proposal(torch.empty(0, dtype=torch.int64), None)


class Proposer(Protocol):
    """Proposes up to k draft tokens given the committed token ids of a sequence."""

    def propose(
        self, seq_id: int, token_ids: list[int], k: int, params: SamplingParams, step: int
    ) -> Proposal:  # pragma: no cover - protocol
        """Return at most ``k`` draft tokens following ``token_ids`` (prompt + committed output)."""

    def release(self, seq_id: int) -> None:  # pragma: no cover - protocol
        """Free any per-sequence state of ``seq_id``."""
