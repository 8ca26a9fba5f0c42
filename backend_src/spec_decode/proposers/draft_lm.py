"""A draft language model proposer (Leviathan et al. 2023; vLLM ``MultiStepWorker``; HF assisted generation).

Any Hugging Face causal-LM folder with the target's tokenizer. It keeps its own per-sequence KV cache
(:class:`~spec_decode.kv_cache.CachedCausalLM`) and samples k tokens autoregressively from its distribution after the
request's sampling transforms, returning those distributions as ``draft_probs`` for rejection sampling.

A draft with a pruned vocabulary (:class:`~spec_decode.models.DraftVocab`, ``draft_vocab.json`` in its folder; as
``make draft`` builds it) reads target ids mapped into its vocabulary and proposes only kept tokens; its probabilities
are scattered back to the target's vocabulary, zero elsewhere, so rejection sampling stays exact.
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
        vocab: the draft's pruned vocabulary, or None when it shares the target's.
    """

    def __init__(self, lm: CachedCausalLM, vocab=None):
        self.lm = lm
        self.vocab = vocab
        self._kept_on_device = None  # vocab.token_ids on the draft's device (copied once, not per token)

    def propose(self, seq_id: int, token_ids: list[int], k: int, params: SamplingParams, step: int) -> Proposal:
        """Sample ``k`` draft tokens (argmax when greedy); noise keyed by (seed, step, position).

        Returns:
            Proposal with draft_token_ids [k] int64 and draft_probs [k, V] float32 (on the draft model's device), or an
            empty proposal for k=0.
        """
        return self.propose_batch([(seq_id, token_ids, k, params, step)])[0]

    def propose_batch(self, items: list[tuple[int, list[int], int, SamplingParams, int]]) -> list[Proposal]:
        """:meth:`propose` for several sequences: each of the k draft positions is one batched forward of the draft
        over the sequences that still need a token (:meth:`CachedCausalLM.logits_batch`).

        Args:
            items: (seq_id, token_ids, k, params, step) per sequence; seq_ids distinct.

        Returns:
            per item, a Proposal as :meth:`propose` returns (the same tokens and probabilities as alone, up to float
            rounding of the batched forward).

        Raises:
            ValueError: a token id outside the draft's vocabulary, or a repeated seq_id.
        """
        vocab = self.vocab
        ids = [vocab.map_ids(t) if vocab is not None else list(t) for _, t, _, _, _ in items]
        drafts: list[list[int]] = [[] for _ in items]
        rows: list[list[torch.Tensor]] = [[] for _ in items]
        for i in range(max((k for _, _, k, _, _ in items), default=0)):
            active = [j for j, it in enumerate(items) if it[2] > i]
            logits = self.lm.logits_batch([(items[j][0], ids[j], 1) for j in active])
            for j, lg in zip(active, logits):
                _, _, _, params, step = items[j]
                lg = lg[0]
                if vocab is not None:
                    lg = lg[: vocab.unk_index]  # never propose the "outside the set" row
                probs = logits_to_probs(lg, params)
                if params.is_greedy:
                    tok = int(torch.argmax(probs))
                else:
                    tok = sample_from(probs, generator_for(params.seed, step, _DRAFT_PURPOSE, i))
                ids[j].append(tok)
                if vocab is not None:
                    if self._kept_on_device is None or self._kept_on_device.device != probs.device:
                        self._kept_on_device = vocab.token_ids.to(probs.device)
                    full = torch.zeros(vocab.target_vocab_size, dtype=torch.float32, device=probs.device)
                    full[self._kept_on_device] = probs.float()
                    probs, tok = full, int(vocab.token_ids[tok])
                drafts[j].append(tok)
                rows[j].append(probs.float())
        return [Proposal(torch.tensor(d, dtype=torch.int64), torch.stack(r)) if d else Proposal.empty()
                for d, r in zip(drafts, rows)]

    def release(self, seq_id: int) -> None:
        """Free the draft KV cache of ``seq_id``."""
        self.lm.release(seq_id)
