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
