"""The draft LM proposer: a small causal LM drafts k tokens (Leviathan et al. 2023; vLLM ``MultiStepWorker``; HF
assisted generation).

Any Hugging Face causal-LM folder with the target's tokenizer. It keeps its own per-sequence KV cache
(:class:`~spec_decode.engine.kv_cache.CachedCausalLM`) and samples k tokens autoregressively from its distribution
after the request's sampling transforms, returning those distributions as ``draft_probs`` for rejection sampling. A
round's sequences share each of the k forwards. A seeded sampled request's drafts race the noise the verifier races
the target with at the same absolute positions (:func:`~spec_decode.proposers.base.draft_token`), so they are coupled
with the target's tokens. A sequence whose next positions lie beyond the draft model's ``max_position_embeddings``
drafts fewer tokens, or none, instead of failing (:meth:`DraftModelProposer.room`).

A draft with a pruned vocabulary (:class:`~spec_decode.engine.draft_vocab.DraftVocab`, ``draft_vocab.json`` in its
folder, as ``make draft`` builds it) reads target ids mapped into its vocabulary and proposes only kept tokens; its
probabilities are scattered back to the target's vocabulary, zero elsewhere, so rejection sampling stays exact.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ...engine.draft_vocab import DraftVocab, load_draft_vocab
from ...engine.kv_cache import CachedCausalLM
from ...engine.model_loading import load_cached_lm
from ...sampling import NoisePurpose
from ...settings import InvalidInputError, LMSettings, in_range
from ...tree import MAX_TREE_TOP_K
from ..base import Proposal, ProposalRequest, Proposer, by_shape, draft_token, slot_outcomes
from .artifacts import draft_lm_configured, resolve_draft_path
from .tree import draft_lm_trees


@dataclass(frozen=True)
class DraftLMSettings(LMSettings):
    """The draft LM's config parameters: ``draft_model_path`` and, as for the target, ``device``, ``dtype``,
    ``max_sequences``.

    Attributes:
        draft_model_path: ``auto`` (the draft distilled by ``make draft`` when it exists, else no draft LM), ``""`` or
            ``none`` (no draft LM: ``speculative_method=draft`` is refused), ``default`` (the embedded target drafting
            for itself; for tests), or a Hugging Face causal-LM folder sharing the target's tokenizer.
        draft_min_token_prob: a step drafts its next slot while the product of its drafts' probabilities so far and
            the slot's top probability is >= this, in [0, 1]; 0 drafts every slot
            (:func:`~spec_decode.proposers.base.confident`).
        draft_tree_top_k: a request that takes trees (``draft_tree``) branches into this many children where the
            draft is unsure, and each level keeps this many nodes to expand (:mod:`.tree`), in [1, 10]; 1: chains.
        draft_branch_prob: a node branches when its most probable child's probability is below this, in [0, 1]
            (0: never, 1: always).
    """

    draft_model_path: str = "auto"
    draft_min_token_prob: float = 0.3
    draft_tree_top_k: int = 2
    draft_branch_prob: float = 0.8

    def check(self) -> None:
        """As :meth:`~spec_decode.settings.LMSettings.check`, draft_min_token_prob and draft_branch_prob in [0, 1],
        draft_tree_top_k in [1, 10]."""
        super().check()
        in_range("draft_min_token_prob", self.draft_min_token_prob, 0.0, 1.0)
        in_range("draft_tree_top_k", self.draft_tree_top_k, 1, MAX_TREE_TOP_K)
        in_range("draft_branch_prob", self.draft_branch_prob, 0.0, 1.0)


class DraftModelProposer(Proposer):
    """Proposes k tokens from a draft LM (``speculative_method=draft``).

    Args:
        lm: the draft model wrapped with its per-sequence KV cache.
        vocab: the draft's pruned vocabulary, or None when it shares the target's.
        min_token_prob: a step stops drafting at the first slot where (the product of its drafts' probabilities so far)
            x (the slot's top probability) falls below this; 0 drafts every slot
            (:func:`~spec_decode.proposers.base.confident`).
        tree_top_k, branch_prob: the shape of the trees it drafts for requests that take them (:mod:`.tree`;
            ``draft_tree_top_k``, ``draft_branch_prob``).
    """

    name = "draft"
    applies_processors = True
    tree_widths = greedy_trees = True
    Settings = DraftLMSettings
    GAUGES = {
        "spec_decode_draft_kv_cache_sequences": "Sequences holding a KV cache in the draft LM",
        "spec_decode_draft_kv_cache_tokens": "Tokens held in the draft LM's KV caches of running sequences",
        "spec_decode_draft_kv_cache_allocated_tokens": "Positions allocated by the draft LM's KV caches, running and "
                                                       "released ones kept for prefix reuse",
        "spec_decode_draft_kv_cache_max_tokens": "Positions of the draft LM's paged KV pool (kv_cache_max_tokens, or "
                                                 "the size chosen from memory when that is 0)",
        "spec_decode_draft_prefix_cache_hit_rate": "Draft LM prefix-cache hits / queries since start",
        "spec_decode_draft_prefix_cache_reused_tokens": "Tokens whose keys and values the draft LM reused from a "
                                                        "cached prefix's shared pages since start",
    }

    def __init__(self, lm: CachedCausalLM, vocab: DraftVocab | None = None, min_token_prob: float = 0.0,
                 tree_top_k: int = DraftLMSettings.draft_tree_top_k,
                 branch_prob: float = DraftLMSettings.draft_branch_prob):
        self.lm = lm
        self.vocab = vocab
        self.min_token_prob = min_token_prob
        self.tree_top_k, self.branch_prob = tree_top_k, branch_prob

    @classmethod
    def configured(cls, settings: DraftLMSettings) -> bool:
        """Whether ``draft_model_path`` names a draft LM (``auto``: when ``make draft`` has built it)."""
        return draft_lm_configured(settings.draft_model_path)

    @classmethod
    def from_config(cls, settings: DraftLMSettings, served) -> DraftModelProposer | None:
        """The draft LM of ``draft_model_path`` on the configured device, or None when there is none.

        Raises:
            FileNotFoundError: a folder that does not exist.
            ValueError: CUDA asked for but not available.
        """
        path = resolve_draft_path(settings.draft_model_path)
        if path is None:
            return None
        return cls(load_cached_lm(path, settings), load_draft_vocab(path), settings.draft_min_token_prob,
                   settings.draft_tree_top_k, settings.draft_branch_prob)

    def draft_ids(self, token_ids: list[int]) -> list[int]:
        """Target ids -> the draft's own ids (a pruned vocabulary's indices; the same ids without one).

        Raises:
            InvalidInputError: an id outside the target's vocabulary (a pruned vocabulary checks the range).
        """
        return self.vocab.map_ids(token_ids) if self.vocab is not None else list(token_ids)

    def check(self, request: ProposalRequest) -> None:
        """Raise InvalidInputError (naming ``token_ids``) for token ids outside the draft's vocabulary (the target's,
        for a pruned one). A sequence longer than the draft LM's positions is not refused: it drafts fewer tokens, or
        none (:meth:`room`)."""
        ids = self.draft_ids(request.token_ids)  # a pruned vocabulary refuses ids outside the target's itself
        if ids and (min(ids) < 0 or max(ids) >= self.lm.vocab_size):
            raise InvalidInputError("token_ids", f"token ids must lie in [0, {self.lm.vocab_size}), got "
                                                 f"{min(ids)}..{max(ids)}")

    def room(self, request: ProposalRequest) -> int:
        """How many drafts ``request`` may get: its k, capped at the draft model's free positions
        (``max_position_embeddings`` - len(token_ids), at least 0; no cap when the model records no bound)."""
        limit = self.lm.max_positions
        return request.k if not limit else max(0, min(request.k, limit - len(request.token_ids)))

    def propose(self, requests: list[ProposalRequest]) -> list[Proposal]:
        """Sample each request's drafts (argmax when greedy; seeded sampled requests race the target's coupled noise
        at each absolute position, others draw noise keyed by (seed, step, slot)) until k (capped by :meth:`room`:
        a sequence past the draft's positions drafts nothing, the others as before), or until the draft is unsure
        (``min_token_prob``): each draft position is one batched forward over the sequences that still draft
        (:meth:`CachedCausalLM.logits_batch`). A request that takes trees (``tree``, room for two nodes or more,
        ``tree_top_k`` > 1, the request's or else the config's) gets a tree that branches where the draft is unsure
        (:mod:`.tree`) instead.

        Returns:
            per request, draft_token_ids [k'] int64 and draft_probs [k', V] float32 on the draft's device (the same as
            alone, up to float rounding of the batched forward); score the sum of the drafts' running probabilities.

        Raises:
            ValueError: a token id outside the draft's vocabulary, or a repeated seq_id.
        """
        ks = [self.room(r) for r in requests]
        trees = [j for j, (r, k) in enumerate(zip(requests, ks))
                 if self.takes_tree(r) and k > 1 and r.tree_shape(self.tree_top_k, 0)[0] > 1]
        return by_shape(len(requests), trees,
                        lambda rows: self._chains([requests[j] for j in rows], [ks[j] for j in rows]),
                        lambda rows: draft_lm_trees(self, [requests[j] for j in rows], [ks[j] for j in rows]))

    def _chains(self, requests: list[ProposalRequest], ks: list[int]) -> list[Proposal]:
        """Chains of up to ``ks[j]`` drafts (:meth:`propose`)."""
        vocab = self.vocab
        ids = [self.draft_ids(r.token_ids) if k > 0 else [] for r, k in zip(requests, ks)]
        drafts: list[list[int]] = [[] for _ in requests]
        rows: list[list[torch.Tensor]] = [[] for _ in requests]
        running, score = [1.0] * len(requests), [0.0] * len(requests)
        active = [j for j, k in enumerate(ks) if k > 0]
        for i in range(max(ks, default=0)):
            logits = self.lm.logits_batch([(requests[j].seq_id, ids[j], 1) for j in active])
            still, picks = [], []
            for j, lg in zip(active, logits):
                lg = lg[0]
                if vocab is not None:
                    lg = lg[: vocab.unk_index]  # never propose the "outside the set" row
                picks.append(draft_token(lg, requests[j], NoisePurpose.DRAFT_LM, i, drafts[j],
                                         None if vocab is None else vocab.token_ids, self.grammar,
                                         None if vocab is None else vocab.target_vocab_size, lazy=True))
            # the slot's tokens, confidence and probabilities in one copy to the host
            for j, (_, probs), (tok, passes, p_tok) in zip(active, picks, slot_outcomes(
                    picks, [running[j] for j in active], self.min_token_prob)):
                if not passes:
                    continue
                running[j] *= p_tok
                score[j] += running[j]
                ids[j].append(tok)
                if vocab is not None:
                    probs, tok = vocab.scatter(probs), int(vocab.token_ids[tok])
                drafts[j].append(tok)
                rows[j].append(probs.float())
                if len(drafts[j]) < ks[j] and running[j] >= self.min_token_prob:  # else no next slot passes
                    still.append(j)
            active = still
            if not active:
                break
        return [Proposal(torch.tensor(d, dtype=torch.int64), torch.stack(r), sc) if d else Proposal.empty()
                for d, r, sc in zip(drafts, rows, score)]

    def release(self, seq_id: int, final_token_ids: list[int] | None = None) -> None:
        """Free the draft KV cache of ``seq_id``."""
        self.lm.release(seq_id)

    def gauges(self) -> dict[str, float]:
        """The draft LM's KV caches: sequences and tokens held, positions allocated against the budget, prefix
        caching's hit rate and reused tokens."""
        lm, stats = self.lm, self.lm.prefix_stats
        return {"spec_decode_draft_kv_cache_sequences": len(lm),
                "spec_decode_draft_kv_cache_tokens": lm.cached_tokens(),
                "spec_decode_draft_kv_cache_allocated_tokens": lm.allocated_tokens(),
                "spec_decode_draft_kv_cache_max_tokens": lm.max_tokens,
                "spec_decode_draft_prefix_cache_hit_rate": stats.hits / max(1, stats.queries),
                "spec_decode_draft_prefix_cache_reused_tokens": stats.reused_tokens}
