"""A draft language model proposer (Leviathan et al. 2023; vLLM ``MultiStepWorker``; HF assisted generation).

Any Hugging Face causal-LM folder with the target's tokenizer. It keeps its own per-sequence KV cache
(:class:`~spec_decode.kv_cache.CachedCausalLM`) and samples k tokens autoregressively from its distribution after the
request's sampling transforms, returning those distributions as ``draft_probs`` for rejection sampling.
"""

from __future__ import annotations

import torch

from ..kv_cache import CachedCausalLM
from ..sampling import SamplingParams, generator_for, logits_to_probs, sample_from
from .base import Proposal

_DRAFT_PURPOSE = 3


class DraftModelProposer:
    """Proposes k tokens from a draft LM.

    Args:
        lm: the draft model wrapped with its per-sequence KV cache.
    """

    def __init__(self, lm: CachedCausalLM):
        self.lm = lm

    def propose(self, seq_id: int, token_ids: list[int], k: int, params: SamplingParams, step: int) -> Proposal:
        """Sample ``k`` draft tokens (argmax when greedy); noise keyed by (seed, step, position).

        Returns:
            Proposal with draft_token_ids [k] int64 and draft_probs [k, V] float32 (on the draft model's device), or an empty proposal for k=0.
        """
        if k <= 0:
            return Proposal.empty()
        ids = list(token_ids)
        drafts: list[int] = []
        probs_rows = []
        for i in range(k):
            logits = self.lm.logits(seq_id, ids, 1)[0]
            probs = logits_to_probs(logits, params)
            if params.is_greedy:
                tok = int(torch.argmax(probs))
            else:
                tok = sample_from(probs, generator_for(params.seed, step, _DRAFT_PURPOSE, i))
            drafts.append(tok)
            probs_rows.append(probs.float())
            ids.append(tok)
        return Proposal(torch.tensor(drafts, dtype=torch.int64), torch.stack(probs_rows))

    def release(self, seq_id: int) -> None:
        """Free the draft KV cache of ``seq_id``."""
        self.lm.release(seq_id)
