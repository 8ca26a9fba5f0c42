"""The target scorer: one forward pass over the pending tokens plus k drafts (vLLM's ``MQAScorer``; gpt-fast).

Returns target probabilities for the k+1 positions after the request's sampling transforms: row i is the target
distribution for the token after draft i-1 (row 0 follows the last committed token; row k is the bonus position), and
the target's last hidden states at the same positions (what a hidden-state speculator drafts from).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from ..sampling import SamplingParams, logits_to_probs
from .kv_cache import CachedCausalLM


class Scores(NamedTuple):
    """One sequence's scores.

    Attributes:
        probs: [k+1, V] float32 target probabilities on the model's device.
        hidden: [k+1, H] the target's last hidden states (model dtype) at those positions: row j is the state after
            the last committed token and the first j drafts.
    """

    probs: torch.Tensor
    hidden: torch.Tensor


class TargetScorer:
    """Scores drafts with the target model on its per-sequence KV cache.

    Args:
        lm: the target model wrapped with its per-sequence KV cache.
    """

    def __init__(self, lm: CachedCausalLM):
        self.lm = lm

    def score(
        self, seq_id: int, token_ids: list[int], draft_token_ids: list[int], params: SamplingParams
    ) -> torch.Tensor:
        """Target probabilities for k+1 positions (:meth:`score_batch` of one sequence, without the hidden states).

        Args:
            seq_id: sequence identifier.
            token_ids: committed token ids (prompt + accepted output), length >= 1.
            draft_token_ids: the k draft tokens (k >= 0).
            params: the request's sampling parameters.

        Returns:
            [k+1, V] float32 on the model's device.

        Raises:
            ValueError: as :meth:`score_batch`.
        """
        return self.score_batch([(seq_id, token_ids, draft_token_ids, params)])[0].probs

    def score_batch(self, items: list[tuple[int, list[int], list[int], SamplingParams]]) -> list[Scores]:
        """The k+1 positions of several sequences in one forward pass (:meth:`~.kv_cache.CachedCausalLM.logits_batch`).

        Args:
            items: (seq_id, token_ids, draft_token_ids, params) per sequence; seq_ids distinct.

        Returns:
            per item, its :class:`Scores` ([k_i+1, V] probabilities, [k_i+1, H] hidden states).

        Raises:
            ValueError: as :meth:`~.kv_cache.CachedCausalLM.logits_batch`.
        """
        calls = [(s, list(ids) + list(d), len(d) + 1) for s, ids, d, _ in items]
        out = self.lm.logits_batch(calls, hidden=True)
        return [Scores(logits_to_probs(lg, p), h) for (lg, h), (_, _, _, p) in zip(out, items)]

    def release(self, seq_id: int) -> None:
        """Free the KV cache of ``seq_id``."""
        self.lm.release(seq_id)
