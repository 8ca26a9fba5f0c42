"""spec_decode.proposers.suffix.proposer: the global tree of earlier responses, request trees, the settings."""

import pytest

from spec_decode.proposers import ProposalRequest, SuffixProposer, SuffixSettings
from spec_decode.proposers.suffix import arctic_available
from spec_decode.sampling import SamplingParams

BACKENDS = ["python", "arctic"]


def _suffix(max_active=256, **settings):
    return SuffixProposer(SuffixSettings(**settings), max_active=max_active)


@pytest.mark.parametrize("backend", BACKENDS)
def test_global_cache_is_fifo_bounded_and_serves_a_repeated_response(backend):
    if backend == "arctic" and not arctic_available():
        pytest.skip("Arctic's suffix tree is not built (test_arctic_suffix_tree_is_installed fails)")
    p = _suffix(max_tree_depth=8, max_cached_requests=2, max_spec_factor=2.0, backend=backend)
    responses = [[10 + r, 20 + r, 30 + r, 40 + r, 50 + r] for r in range(3)]
    for seq, resp in enumerate(responses):
        p.speculate(seq, [1, 2, 3], 4)  # first step: the prompt
        p.speculate(seq, [1, 2, 3] + resp, 4)
        p.release(seq)
    assert p.cache.cached_requests == 2 and p.active_requests() == 0
    # A new request whose output starts like a cached response gets it, with probability 1 per token (the global
    # tree does not hold the request's own occurrence); the oldest response was evicted.
    d = p.speculate(99, [7, 7, 11, 21], 3)
    assert d.token_ids == [31, 41, 51] and d.score == pytest.approx(3.0)
    assert p.speculate(98, [7, 7, 10, 20], 3).token_ids == []
    assert p.cache.cached_tokens() == 10
    p.release(98)
    p.release(99)
    assert p.active_requests() == 0


@pytest.mark.parametrize("backend", BACKENDS)
def test_active_requests_are_bounded_and_restart_on_divergence(backend):
    if backend == "arctic" and not arctic_available():
        pytest.skip("Arctic's suffix tree is not built (test_arctic_suffix_tree_is_installed fails)")
    p = _suffix(max_tree_depth=8, max_cached_requests=4, max_active=3, backend=backend)
    for seq in range(5):
        p.speculate(seq, [seq, 1, 2], 2)
    assert p.active_requests() == 3
    p.speculate(4, [9, 9, 9, 9], 2)  # not an extension of [4, 1, 2]: the sequence starts over, nothing raises
    assert p.active_requests() == 3


def test_unknown_backend_is_rejected():
    with pytest.raises(ValueError, match="'suffix_backend': 'rust' is not one of auto, arctic, python"):
        SuffixSettings(backend="rust")


@pytest.mark.parametrize("backend", BACKENDS)
def test_request_tree_follows_the_sequence_and_prompt_repetition(backend):
    if backend == "arctic" and not arctic_available():
        pytest.skip("Arctic's suffix tree is not built (test_arctic_suffix_tree_is_installed fails)")
    p = _suffix(max_tree_depth=16, max_cached_requests=0, max_spec_factor=2.0, backend=backend)
    prompt = [5, 6, 7, 8, 9, 1, 2]
    assert p.propose_one(1, prompt + [5, 6], 3, None, 0).draft_token_ids.tolist() == [7, 8, 9]
    assert p.propose_one(1, prompt + [5, 6, 7, 8], 2, None, 1).draft_token_ids.tolist() == [9, 1]


def test_every_request_drafts_from_the_global_suffix_tree():
    """Greedy, unseeded and seeded requests all draft from earlier responses: a seeded request's tokens do not
    depend on its drafts (the verifier's coupled race, tests/unit/test_seeded_invariance.py), so it need not skip
    them."""
    p = _suffix(backend="python")
    earlier = [1, 2, 3, 4, 5, 6, 7, 8]
    p.speculate(1, earlier[:2], 4)
    p.release(1, earlier)  # with its final ids: the response 3..8 is now in the global tree
    ctx = [9, 3, 4, 5]
    greedy, seeded, unseeded = SamplingParams(), SamplingParams(0.8, seed=1), SamplingParams(0.8, seed=1, seeded=False)
    for seq_id, params in ((2, greedy), (3, unseeded), (4, seeded)):
        assert p.propose_one(seq_id, ctx, 3, params, 0).draft_token_ids.tolist() == [6, 7, 8]


def test_proposals_carry_their_score_and_gauges_follow_the_trees():
    p = _suffix(backend="python", max_spec_factor=4.0)
    p.speculate(1, [9], 3)
    p.release(1, [9, 1, 2, 3, 4])
    greedy = SamplingParams()
    (hit, miss) = p.propose([ProposalRequest(2, [8, 1, 2], 2, greedy, 0), ProposalRequest(3, [7, 6], 2, greedy, 0)])
    assert hit.draft_token_ids.tolist() == [3, 4] and hit.score == pytest.approx(2.0) and hit.draft_probs is None
    assert miss.draft_token_ids.tolist() == [] and miss.score == 0.0
    assert p.gauges() == {"spec_decode_suffix_active_requests": 2, "spec_decode_suffix_cached_responses": 1,
                          "spec_decode_suffix_cached_tokens": 4,
                          "spec_decode_suffix_max_cached_tokens": SuffixSettings().max_cached_tokens}
    assert set(p.gauges()) == set(SuffixProposer.GAUGES)
    p.release(2)
    p.release(3)
    assert p.gauges()["spec_decode_suffix_active_requests"] == 0
