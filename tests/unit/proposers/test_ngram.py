"""spec_decode.proposers.ngram: prompt lookup."""

from spec_decode.proposers import NgramProposer, NgramSettings
from spec_decode.sampling import SamplingParams

GREEDY = SamplingParams()


def _ngram(min_n, max_n):
    return NgramProposer(NgramSettings(min=min_n, max=max_n))


def test_ngram_proposes_continuation_of_most_recent_match():
    p = _ngram(1, 3)
    ids = [5, 6, 7, 8, 1, 5, 6, 7, 9, 2, 5, 6, 7]
    # The tail [5, 6, 7] last occurred at index 5, followed by 9, 2, 5.
    assert p.propose_one(0, ids, 3, GREEDY, 0).draft_token_ids.tolist() == [9, 2, 5]
    assert p.propose_one(0, ids, 10, GREEDY, 0).draft_token_ids.tolist() == [9, 2, 5, 6, 7]
    assert p.propose_one(0, [1, 2, 3], 4, GREEDY, 0).draft_token_ids.numel() == 0  # no match
    assert p.propose_one(0, ids, 0, GREEDY, 0).draft_token_ids.numel() == 0
    assert p.propose_one(0, ids, 3, GREEDY, 0).draft_probs is None


def test_ngram_falls_back_to_shorter_matches():
    p = _ngram(1, 4)
    assert p.propose_one(0, [4, 9, 3, 1, 2, 4], 2, GREEDY, 0).draft_token_ids.tolist() == [9, 3]


def test_a_round_gets_one_proposal_per_sequence_in_order():
    from spec_decode.proposers import ProposalRequest

    p = _ngram(1, 3)
    reqs = [ProposalRequest(1, [5, 6, 7, 5, 6], 2, GREEDY, 0), ProposalRequest(2, [1, 2, 3], 2, GREEDY, 0),
            ProposalRequest(3, [4, 9, 3, 1, 2, 4], 1, GREEDY, 0)]
    assert [x.draft_token_ids.tolist() for x in p.propose(reqs)] == [[7, 5], [], [9]]


def _tree(p, ids, k):
    from spec_decode.proposers import ProposalRequest
    from spec_decode.tree import check_tree

    (out,) = p.propose([ProposalRequest(0, ids, k, GREEDY, 0, tree=True)])
    parents = None if out.draft_parents is None else out.draft_parents.tolist()
    check_tree(out.draft_token_ids.tolist(), parents)
    assert out.draft_probs is None and out.draft_token_ids.numel() <= k
    return out.draft_token_ids.tolist(), parents


def test_a_tree_of_one_match_is_today_s_chain():
    p = _ngram(1, 3)
    ids = [5, 6, 7, 8, 1, 5, 6, 7, 9, 2, 5, 6, 7]  # [5, 6, 7] twice, but the latest's k tokens fill the tree
    for k in (1, 3, 5):
        assert _tree(p, ids, k) == (p.propose_one(0, ids, k, GREEDY, 0).draft_token_ids.tolist(), None)
    # room left after the latest match's 5 tokens: the earlier match's continuation branches off
    assert _tree(p, ids, 7) == ([9, 2, 5, 6, 7, 8, 1], [-1, 0, 1, 2, 3, -1, 5])
    assert _tree(p, [4, 9, 3, 1, 2, 4], 2) == ([9, 3], None)
    assert _tree(p, [1, 2, 3], 4) == ([], None)


def test_earlier_matches_branch_the_tree_within_k_nodes():
    p = _ngram(1, 2)
    # [5, 6] was followed by 1 2 (at 0), then 3 5 6 (at 4, the latest, cut by the end of the sequence)
    ids = [5, 6, 1, 2, 5, 6, 3, 5, 6]
    assert p.propose_one(0, ids, 5, GREEDY, 0).draft_token_ids.tolist() == [3, 5, 6]  # the chain
    assert _tree(p, ids, 5) == ([3, 5, 6, 1, 2], [-1, 0, 1, -1, 3])  # the latest match's first
    assert _tree(p, ids, 4) == ([3, 5, 6, 1], [-1, 0, 1, -1])
    # Continuations offered by more matches are kept first: 1 2 0 5 twice, 3 4 0 5 once (the latest)
    ids = [5, 6, 1, 2, 0, 5, 6, 1, 2, 0, 5, 6, 3, 4, 0, 5, 6]
    assert _tree(p, ids, 6) == ([3, 1, 2, 0, 5, 6], [-1, -1, 1, 2, 3, 4])
    assert _tree(p, ids, 7) == ([3, 4, 1, 2, 0, 5, 6], [-1, 0, -1, 2, 3, 4, 5])


def test_branch_paths_keeps_every_kept_node_s_prefix():
    import random

    from spec_decode.proposers.ngram import branch_paths

    rng = random.Random(0)
    for _ in range(200):
        paths = [[rng.randrange(3) for _ in range(rng.randrange(1, 5))] for _ in range(rng.randrange(1, 5))]
        budget = rng.randrange(0, 10)
        cut = branch_paths(paths, budget)
        assert all(c == p[: len(c)] for c, p in zip(cut, paths))
        nodes = {tuple(c[:d]) for c in cut for d in range(1, len(c) + 1)}
        everything = {tuple(p[:d]) for p in paths for d in range(1, len(p) + 1)}
        assert len(nodes) == min(budget, len(everything))
