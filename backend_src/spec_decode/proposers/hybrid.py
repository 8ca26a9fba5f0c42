"""Hybrid proposer (Arctic Inference): the suffix draft when its score reaches k, otherwise another proposer's.

The score of a suffix draft is the expected number of accepted tokens (sum of its running probabilities), so score >= k
means suffix matching expects to fill all k draft slots; otherwise the fallback proposer (the EAGLE head, the draft
LM, or n-gram prompt lookup) drafts this step, unless it proposes nothing or its own score (the head's or the draft
LM's estimate of its accepted count) is below the suffix score, where the suffix draft stays. Both are composed
through the proposer contract: one suffix call for the round's sequences, then one fallback call for those whose
score fell short (the others are shown to the fallback with ``observe``). The request's suffix tree is updated every
step either way.

A request with ``tree`` set reaches both parts as it is: suffix decoding then drafts its speculation tree (Oliaro et
al., "SuffixDecoding", arXiv 2411.04975), n-gram lookup a tree of several matches, and the model proposers, which draft
chains, ignore the flag. The choice rule is the same. When neither the chosen proposal nor the other has draft
probabilities (suffix with n-gram, or with Medusa's one-hot drafts), the other's nodes join the chosen tree where they
fit within k nodes (:func:`merge_trees`: shared prefixes merged, the chosen tree's nodes first); a proposal with draft
probabilities is never mixed with nodes that have none (the model's chain is kept as it is).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..settings import ConfigSettings
from ..tree import merge_paths, path_tokens
from .base import Proposal, ProposalRequest, Proposer

_HEADS = ("eagle3", "eagle", "arctic", "mlp_speculator", "medusa")  # the heads of speculator_path, best first
FALLBACKS = ("ngram", "draft", *_HEADS, "auto")  # hybrid_fallback's values
_AUTO = (*_HEADS, "draft", "ngram")  # auto: the first of these served (Arctic pairs suffix with a model speculator)


@dataclass(frozen=True)
class HybridSettings(ConfigSettings):
    """Config parameter ``hybrid_fallback``: the proposer used when the suffix score is below k: ``ngram``,
    ``draft`` (needs a draft LM), a head of ``speculator_path`` (``eagle3``, ``eagle``, ``arctic``,
    ``mlp_speculator``, ``medusa``) or ``auto`` (the first served of those heads in that order, else the draft LM when
    there is one, else ``ngram``)."""

    PREFIX = "hybrid_"
    fallback: str = "ngram"

    def check(self) -> None:
        """fallback is one of :data:`FALLBACKS` (stored lower-cased)."""
        self._choice("fallback", FALLBACKS)


def merge_trees(first: Proposal, second: Proposal, max_nodes: int) -> Proposal:
    """Two proposals without draft probabilities as one tree of at most ``max_nodes`` nodes: ``first`` whole (its
    nodes keep their order), then the nodes of ``second`` that ``first`` lacks, in ``second``'s order, while they fit.
    The result keeps ``first``'s score."""
    paths = []
    for p in (first, second):
        parents = None if p.draft_parents is None else p.draft_parents.tolist()
        paths += path_tokens(p.draft_token_ids.tolist(), parents)[1:]  # node i's path, for every node in order
    tokens, parents = merge_paths(paths, max_nodes)
    return Proposal.of(tokens, first.score, parents)


class HybridProposer(Proposer):
    """Suffix decoding with a fallback proposer (``speculative_method=hybrid``).

    Args:
        suffix: a proposer whose proposals carry a score (the suffix proposer, shared with
            ``speculative_method=suffix``).
        fallback: the proposer used when the score is below k.
    """

    name = "hybrid"
    Settings = HybridSettings
    needs_hidden_states = True  # its fallback may draft from them (the EAGLE head)

    def __init__(self, suffix: Proposer, fallback: Proposer):
        self.suffix = suffix
        self.fallback = fallback

    @classmethod
    def from_config(cls, settings: HybridSettings, served) -> HybridProposer:
        """Hybrid over the served ``suffix`` proposer and the configured fallback.

        Raises:
            ValueError: ``hybrid_fallback`` names a proposer not served (the draft LM or a head without its model).
        """
        fallback = settings.fallback
        if fallback == "auto":
            fallback = next(name for name in _AUTO if name in served)
        if fallback not in served:
            raise ValueError(f"config parameter 'hybrid_fallback': {fallback!r} is not served here (draft needs a "
                             f"draft LM: draft_model_path; a head its folder in speculator_path)")
        return cls(served["suffix"], served[fallback])

    def check(self, request: ProposalRequest) -> None:
        """The fallback's check (the suffix proposer takes any ids)."""
        self.fallback.check(request)

    def propose(self, requests: list[ProposalRequest]) -> list[Proposal]:
        """Per request, the suffix draft if its score >= k, else the fallback's proposal, unless the fallback
        proposes nothing or scores its proposal (the model proposers do) below the suffix score: then the suffix
        draft. For a request with ``tree`` set, two proposals without draft probabilities are merged, the chosen one
        first, within k nodes (a suffix draft whose score reaches k already fills k nodes)."""
        out = self.suffix.propose(requests)
        short = [i for i, (r, p) in enumerate(zip(requests, out)) if (p.score or 0.0) < r.k]
        if len(short) < len(requests):  # the fallback sees the steps it does not draft too (the EAGLE head's context)
            drafting = set(short)
            self.fallback.observe([r for i, r in enumerate(requests) if i not in drafting])
        if short:
            for i, p in zip(short, self.fallback.propose([requests[i] for i in short])):
                mine = out[i].score or 0.0
                taken = len(p.draft_token_ids) > 0 and (p.score is None or p.score >= mine)
                chosen, other = (p, out[i]) if taken else (out[i], p)
                mixable = chosen.draft_probs is None and other.draft_probs is None  # never q rows with one-hot nodes
                if requests[i].tree and mixable and len(other.draft_token_ids):
                    chosen = merge_trees(chosen, other, requests[i].k)
                out[i] = chosen
        return out

    def release(self, seq_id: int, final_token_ids: list[int] | None = None) -> None:
        """Free both proposers' state of ``seq_id`` (the suffix response joins the global tree)."""
        self.suffix.release(seq_id, final_token_ids)
        self.fallback.release(seq_id, final_token_ids)
