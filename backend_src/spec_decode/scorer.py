"""The target scorer: one forward pass over the pending tokens plus k drafts (vLLM ``Scorer``; gpt-fast).

Returns target probabilities for the k+1 positions after the request's sampling transforms: row i is the target
distribution for the token after draft i-1 (row 0 follows the last committed token; row k is the bonus position).
"""

from __future__ import annotations

import torch

from .kv_cache import CachedCausalLM
from .sampling import SamplingParams, logits_to_probs


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
        """Target probabilities for k+1 positions.

        Args:
            seq_id: sequence identifier.
            token_ids: committed token ids (prompt + accepted output), length >= 1.
            draft_token_ids: the k draft tokens (k >= 0).
            params: the request's sampling parameters.

        Returns:
            [k+1, V] float32 on the model's device.
        """
        k = len(draft_token_ids)
        logits = self.lm.logits(seq_id, list(token_ids) + list(draft_token_ids), k + 1)
        return logits_to_probs(logits, params)

    def score_batch(self, items: list[tuple[int, list[int], list[int], SamplingParams]]) -> list[torch.Tensor]:
        """:meth:`score` for several sequences in one forward pass (:meth:`CachedCausalLM.logits_batch`).

        Args:
            items: (seq_id, token_ids, draft_token_ids, params) per sequence; seq_ids distinct.

        Returns:
            per item, [k_i+1, V] float32 probabilities on the model's device.

        Raises:
            ValueError: as :meth:`CachedCausalLM.logits_batch`.
        """
        calls = [(s, list(ids) + list(d), len(d) + 1) for s, ids, d, _ in items]
        logits = self.lm.logits_batch(calls)
        return [logits_to_probs(lg, p) for lg, (_, _, _, p) in zip(logits, items)]

    def release(self, seq_id: int) -> None:
        """Free the KV cache of ``seq_id``."""
        self.lm.release(seq_id)
