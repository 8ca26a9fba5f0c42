"""The Medusa proposer: a round's drafts from one forward of the heads over the requests' last hidden states."""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from ....sampling import NoisePurpose
from ...base import Proposal, ProposalRequest, draft_distribution, draft_token, slot_outcomes, top_k_to_host
from ..base import HeadProposer, SpeculatorSettings
from ..target import TargetInfo
from .model import MedusaHead
from .published import load_medusa
from .tree import TOP_K, choices_tree, dynamic_tree, parse_choices, tree_drafts

logger = logging.getLogger(__name__)


class MedusaProposer(HeadProposer):
    """Drafts with published Medusa heads (``speculative_method=medusa``; vLLM's ``MedusaProposer``, FasterDecoding's
    top-1 candidates).

    A round's requests share one forward of the heads over their last hidden states (the state that predicted the
    last committed token): head i's distribution, after the request's processors and sampling transforms
    (:func:`~spec_decode.proposers.base.draft_token`), proposes slot i, and the draft is its argmax. Medusa's drafts
    are deterministic, so proposals carry no ``draft_probs`` (the verifier takes q one-hot, which keeps rejection
    sampling exact). A request drafts up to min(k, n) slots and stops at the first slot that fails
    :func:`~spec_decode.proposers.base.confident`; its score is the sum of its drafts' running probabilities. A
    request without hidden states (its first step) gets no drafts. The heads keep no per-sequence state.

    A request that takes trees (``draft_tree``, k >= 2) gets a candidate tree of at most k nodes instead, as Medusa's
    authors verify one: combinations of its heads' top-k tokens chosen by ``medusa_choices`` (:mod:`.tree`: the paths
    of highest joint probability, or a published fixed tree's first nodes), each node passing the confidence rule on
    its joint probability.

    Args:
        head: a :class:`MedusaHead` (on its device and dtype).
        hidden_size: H, the target's hidden size.
        settings: the :class:`~.base.SpeculatorSettings` it is served with.
    """

    name = "medusa"
    greedy_trees = False  # its chains are argmaxes too: a tree for every request
    head: MedusaHead

    def __init__(self, head: MedusaHead, hidden_size: int, settings: SpeculatorSettings):
        super().__init__(head, hidden_size, settings)
        self.choices = parse_choices(settings.medusa_choices)  # None: the dynamic tree
        deep = [p for p in self.choices or () if len(p) > head.num_heads]
        if deep:
            logger.warning("medusa_choices: %d of its %d paths are deeper than this head's %d heads and are never "
                           "drafted (the first: %s)", len(deep), len(self.choices or ()), head.num_heads,
                           list(deep[0])[:8])

    @classmethod
    def load(cls, folder: Path, target: TargetInfo) -> MedusaHead:
        """:func:`load_medusa`.

        Raises:
            SpeculatorLoadError: naming the file and the key that does not fit.
        """
        return load_medusa(folder, target)

    @torch.inference_mode()
    def propose(self, requests: list[ProposalRequest]) -> list[Proposal]:
        """One proposal per request, in order: [k'] int64 drafts, k' <= min(k, n heads), ``draft_probs`` None, score
        the sum of the running products of the drafts' probabilities (empty without hidden states).

        Raises:
            ValueError: from a request's grammar (:func:`~spec_decode.proposers.base.draft_token`).
        """
        out = [Proposal.empty() for _ in requests]
        live, states = self.last_states(requests, self.hidden_size)
        if not live or states is None:
            return out
        # a tree's depth is the heads' (its node budget is k); a chain's length min(k, heads)
        ks = [self.head.num_heads if self._as_tree(requests[j]) else min(requests[j].k, self.head.num_heads)
              for j in live]
        logits = self.head(states, max(ks))  # [n', B, V] float32 on the head's device
        vocab = logits.shape[-1]
        for row, (j, k) in enumerate(zip(live, ks)):
            r = requests[j]
            if self._as_tree(r):
                out[j] = self._tree(logits[:k, row], r, vocab)
                continue
            drafts: list[int] = []
            running, score = 1.0, 0.0
            for i in range(k):
                _, probs = draft_token(logits[i, row], r, NoisePurpose.MEDUSA, i, drafts, None, self.grammar, vocab,
                                       lazy=True)
                # the head's argmax (Medusa drafts its heads' top token), its confidence and probability: one read
                ((tok, passes, p_tok),) = slot_outcomes([(torch.argmax(probs), probs)], [running],
                                                        self.min_token_prob)
                if not passes:
                    break
                running *= p_tok
                drafts.append(tok)
                score += running
            if drafts:
                out[j] = Proposal(torch.tensor(drafts, dtype=torch.int64), None, score)
        return out

    def _as_tree(self, request: ProposalRequest) -> bool:
        """Whether ``request`` is drafted as a candidate tree: it takes trees and has room for more than one node."""
        return self.takes_tree(request) and request.k > 1 and self.head.num_heads > 0

    def _tree(self, logits: torch.Tensor, request: ProposalRequest, vocab: int) -> Proposal:
        """A candidate tree of at most ``request.k`` nodes from the heads' logits [n, V] (:mod:`.tree`): each head's
        top-k after the request's processors and sampling transforms, read by the host in one copy, combined by
        ``medusa_choices`` (the joint-probability rule, or a fixed tree's first nodes). A request's ``tree_top_k``
        and ``tree_depth`` narrow what the tree draws from: each head's top ``tree_top_k`` and the first
        ``tree_depth`` heads. Drafts without probabilities (deterministic, as the chain's); a tree of one path is
        returned as a chain."""
        top_k, depth = request.tree_shape(TOP_K, 0)
        probs = torch.stack([draft_distribution(logits[i], request, [], None, self.grammar)
                             for i in range(min(logits.shape[0], depth))])
        top_probs, top_ids = top_k_to_host(probs, min(top_k, vocab))
        paths = (dynamic_tree(top_probs, request.k, self.min_token_prob) if self.choices is None
                 else choices_tree(self.choices, top_probs, request.k, self.min_token_prob))
        if not paths:
            return Proposal.empty()
        tokens, parents, score = tree_drafts(paths, top_ids, top_probs)
        return Proposal.of(tokens, score, parents)
