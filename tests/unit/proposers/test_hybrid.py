"""spec_decode.proposers.hybrid: the suffix draft when its score reaches k, else the fallback's (the contract)."""

import torch

from spec_decode.proposers import HybridProposer, Proposal, ProposalRequest, Proposer, SuffixProposer, SuffixSettings
from spec_decode.sampling import SamplingParams

GREEDY = SamplingParams()


class _Fixed(Proposer):
    """A proposer that always proposes the same tokens (records its calls and releases)."""

    name = "fixed"

    def __init__(self, tokens):
        self.tokens, self.calls, self.released = tokens, [], []

    def propose(self, requests):
        self.calls.append([r.seq_id for r in requests])
        return [Proposal(torch.tensor(self.tokens[: r.k]), None) for r in requests]

    def release(self, seq_id, final_token_ids=None):
        self.released.append(seq_id)


def test_hybrid_uses_suffix_only_when_its_score_reaches_k():
    suffix, fallback = SuffixProposer(SuffixSettings(max_spec_factor=4.0)), _Fixed([90, 91, 92])
    hybrid = HybridProposer(suffix, fallback)
    # An earlier response 1..6 sits in the global trie; a new request ending in [1, 2] matches it with running
    # probabilities 1, 1, 1 -> score 3 >= k = 3. (In the request's own trie the current occurrence of the context
    # counts too, as in Arctic Inference, so one earlier repetition gives 1/2 per token there.)
    suffix.speculate(0, [9], 3)
    suffix.release(0, [9, 1, 2, 3, 4, 5, 6])
    assert hybrid.propose_one(1, [8, 1, 2], 3, GREEDY, 0).draft_token_ids.tolist() == [3, 4, 5]
    assert fallback.calls == []
    # No repetition: the suffix score is 0 < k, so the fallback drafts.
    assert hybrid.propose_one(2, [7, 8, 9], 3, GREEDY, 0).draft_token_ids.tolist() == [90, 91, 92]
    assert fallback.calls == [[2]]
    hybrid.release(2)
    assert fallback.released == [2]


def test_a_round_goes_to_the_fallback_in_one_call_for_the_sequences_whose_score_fell_short():
    suffix, fallback = SuffixProposer(SuffixSettings(max_spec_factor=4.0)), _Fixed([90, 91, 92])
    hybrid = HybridProposer(suffix, fallback)
    suffix.speculate(0, [9], 3)
    suffix.release(0, [9, 1, 2, 3, 4, 5, 6])
    reqs = [ProposalRequest(1, [7, 8, 9], 3, GREEDY, 0), ProposalRequest(2, [8, 1, 2], 3, GREEDY, 0),
            ProposalRequest(3, [5, 5, 5], 2, GREEDY, 0)]
    out = hybrid.propose(reqs)
    assert [p.draft_token_ids.tolist() for p in out] == [[90, 91, 92], [3, 4, 5], [90, 91]]
    assert fallback.calls == [[1, 3]]  # one call for the round's short-scored sequences, in order
    assert out[1].score == 3.0


class _Scored(Proposer):
    """Proposes ``tokens[:k]`` with a fixed score (None: unscored), or nothing when ``tokens`` is empty."""

    name = "scored"

    def __init__(self, tokens, score):
        self.tokens, self.score = tokens, score

    def propose(self, requests):
        return [Proposal(torch.tensor(self.tokens[: r.k], dtype=torch.int64), None, self.score) for r in requests]


def test_a_short_suffix_draft_stays_when_the_fallback_has_nothing_or_scores_lower():
    req = [ProposalRequest(1, [1, 2], 3, GREEDY, 0)]

    def drafts(fallback):
        return HybridProposer(_Scored([7, 8], 1.5), fallback).propose(req)[0].draft_token_ids.tolist()

    assert drafts(_Scored([4, 5, 6], 2.0)) == [4, 5, 6]  # the speculator expects more: its draft
    assert drafts(_Scored([4, 5, 6], 1.0)) == [7, 8]  # it expects less than suffix matching: suffix's
    assert drafts(_Scored([4, 5, 6], None)) == [4, 5, 6]  # an unscored fallback (n-gram, draft LM) drafts
    assert drafts(_Scored([], None)) == [7, 8]  # ... unless it has nothing


def test_the_fallback_observes_the_steps_suffix_drafts():
    """Rows whose suffix score reaches k go to the fallback's observe (an EAGLE head keeps its contexts whole), the
    others to its propose; each row once."""
    class _Recording(_Scored):
        def __init__(self):
            super().__init__([4, 5, 6], None)
            self.seen = {"observe": [], "propose": []}

        def observe(self, requests):
            self.seen["observe"] += [r.seq_id for r in requests]

        def propose(self, requests):
            self.seen["propose"] += [r.seq_id for r in requests]
            return super().propose(requests)

    class _BySeq(_Scored):  # suffix's score: 3 for odd sequences (>= k = 3), 0 for even ones
        def propose(self, requests):
            return [Proposal(torch.tensor([9, 9, 9]), None, 3.0 if r.seq_id % 2 else 0.0) for r in requests]

    fallback = _Recording()
    reqs = [ProposalRequest(s, [1, 2], 3, GREEDY, 0) for s in range(1, 6)]
    out = HybridProposer(_BySeq([], None), fallback).propose(reqs)
    assert fallback.seen == {"observe": [1, 3, 5], "propose": [2, 4]}
    assert [o.draft_token_ids.tolist() for o in out] == [[9, 9, 9], [4, 5, 6], [9, 9, 9], [4, 5, 6], [9, 9, 9]]


class _Tree(Proposer):
    """Proposes a fixed tree (tokens, parents, score, with or without draft probabilities); records each request's
    ``tree``."""

    name = "tree"

    def __init__(self, tokens, parents=None, score=None, probs=False):
        self.tokens, self.parents, self.score, self.probs, self.trees = tokens, parents, score, probs, []

    def propose(self, requests):
        self.trees += [r.tree for r in requests]
        out = []
        for _ in requests:
            p = Proposal.of(self.tokens, self.score, self.parents)
            if self.probs and self.tokens:
                p.draft_probs = torch.full((len(self.tokens), 16), 1 / 16)
            out.append(p)
        return out


def _hybrid_tree(suffix, fallback, k=4, tree=True):
    (p,) = HybridProposer(suffix, fallback).propose([ProposalRequest(1, [1, 2], k, GREEDY, 0, tree=tree)])
    return p.draft_token_ids.tolist(), None if p.draft_parents is None else p.draft_parents.tolist(), p


def test_with_tree_set_both_parts_see_it_and_model_free_proposals_merge_within_k():
    suffix, fallback = _Tree([7, 8, 5], [-1, 0, -1], 1.0), _Tree([7, 9, 10])
    # the fallback (unscored, model-free) is chosen as before; suffix's nodes join it where they fit in k = 4
    assert _hybrid_tree(suffix, fallback)[:2] == ([7, 9, 10, 8], [-1, 0, 1, 0])
    assert suffix.trees == [True] and fallback.trees == [True]
    assert _hybrid_tree(suffix, fallback, k=6)[:2] == ([7, 9, 10, 8, 5], [-1, 0, 1, 0, -1])
    assert _hybrid_tree(suffix, fallback, k=3)[:2] == ([7, 9, 10], None)
    # tree not set: the chosen proposal alone, as before
    assert _hybrid_tree(suffix, fallback, tree=False)[:2] == ([7, 9, 10], None)
    # the suffix draft chosen (the fallback has nothing, or scores lower): it comes first
    assert _hybrid_tree(suffix, _Tree([]))[:2] == ([7, 8, 5], [-1, 0, -1])
    tokens, parents, p = _hybrid_tree(suffix, _Tree([7, 9], None, 0.5))
    assert (tokens, parents, p.score) == ([7, 8, 5, 9], [-1, 0, -1, 0], 1.0)


def test_a_proposal_with_draft_probabilities_is_never_mixed_with_model_free_nodes():
    suffix = _Tree([7, 8, 5], [-1, 0, -1], 1.0)
    tokens, parents, p = _hybrid_tree(suffix, _Tree([7, 9, 10], score=2.0, probs=True), k=6)
    assert (tokens, parents, tuple(p.draft_probs.shape)) == ([7, 9, 10], None, (3, 16))  # the model's chain
    tokens, parents, p = _hybrid_tree(suffix, _Tree([7, 9, 10], score=0.5, probs=True), k=6)
    assert (tokens, parents, p.draft_probs) == ([7, 8, 5], [-1, 0, -1], None)  # suffix's tree alone


def test_suffix_and_ngram_with_tree_set_merge_into_one_tree():
    """Suffix decoding and n-gram lookup (both model-free): n-gram's chain (chosen: suffix's score 3 < k) with suffix
    decoding's draft from an earlier response beside it, k nodes at most."""
    from spec_decode.proposers import NgramProposer
    from spec_decode.tree import check_tree

    suffix = SuffixProposer(SuffixSettings(max_spec_factor=2.0, backend="python"))
    suffix.speculate(0, [9], 3)
    suffix.release(0, [9, 1, 2, 3, 50, 51, 52])
    hybrid = HybridProposer(suffix, NgramProposer())
    (p,) = hybrid.propose([ProposalRequest(1, [1, 2, 3, 4, 1, 2, 3], 6, GREEDY, 0, tree=True)])
    tokens, parents = p.draft_token_ids.tolist(), p.draft_parents.tolist()
    assert (tokens, parents) == ([4, 1, 2, 3, 50, 51], [-1, 0, 1, 2, -1, 4])
    check_tree(tokens, parents)
    (p,) = hybrid.propose([ProposalRequest(2, [1, 2, 3, 4, 1, 2, 3], 6, GREEDY, 0)])
    assert p.draft_token_ids.tolist() == [4, 1, 2, 3] and p.draft_parents is None  # no tree: n-gram's chain
