"""Suffix decoding: the trie's counts, probabilities and chosen match equal a brute-force reference; eviction bounds."""

import random

import pytest

from spec_decode.proposers.suffix import SuffixProposer, SuffixTree, speculate


def _count(seqs, s):
    """Occurrences of the string s in a list of sequences (brute force)."""
    n = len(s)
    return sum(1 for seq in seqs for i in range(len(seq) - n + 1) if seq[i : i + n] == s)


def _brute_speculate(seqs, depth, context, k, factor, offset, min_prob):
    best = ([], 0.0, 0)
    for m in range(1, min(depth, len(context)) + 1):
        suffix = context[len(context) - m :]
        if _count(seqs, suffix) == 0:
            break
        allowed = min(k, int(m * factor + offset))
        s, toks, probs, prob = list(suffix), [], [], 1.0
        while len(toks) < allowed and len(s) < depth:
            counts = {t: _count(seqs, s + [t]) for t in set(x for seq in seqs for x in seq)}
            counts = {t: c for t, c in counts.items() if c > 0}
            if not counts:
                break
            tok = max(counts, key=lambda t: (counts[t], -t))
            prob *= counts[tok] / _count(seqs, s)
            if prob < min_prob:
                break
            toks.append(tok)
            probs.append(prob)
            s.append(tok)
        score = sum(probs)
        if score > best[1] or (score == best[1] and score > 0):
            best = (toks, score, m)
    return best


@pytest.mark.parametrize("seed", range(8))
def test_speculation_equals_brute_force(seed):
    rng = random.Random(seed)
    depth = rng.choice([3, 5, 8])
    seqs = [[rng.randrange(4) for _ in range(rng.randrange(5, 30))] for _ in range(rng.randrange(1, 4))]
    tree = SuffixTree(depth)
    for s in seqs:
        tree.add_sequence(s)
    for s in seqs:  # counts of every substring up to the depth
        for i in range(len(s)):
            for j in range(i + 1, min(len(s), i + depth) + 1):
                assert tree.find(s[i:j])[0] == _count(seqs, s[i:j])
    for _ in range(5):
        context = [rng.randrange(4) for _ in range(rng.randrange(1, 10))]
        k, factor, offset, min_prob = rng.choice([2, 4, 8]), rng.choice([0.5, 1.0, 2.0]), rng.choice([0, 1]), rng.choice([0.05, 0.1, 0.3])
        got = speculate(tree, context, k, factor, offset, min_prob)
        toks, score, m = _brute_speculate(seqs, depth, context, k, factor, offset, min_prob)
        # A request's own trie: its current sequence is the context, and the known suffix nodes give the same answer.
        own = SuffixTree(depth)
        for s in seqs:
            own.add_sequence(s)
        own.extend(context)
        via_nodes = speculate(own, context, k, factor, offset, min_prob, nodes=own.suffix_nodes())
        assert (via_nodes.tokens, via_nodes.match_len) == (speculate(own, context, k, factor, offset, min_prob).tokens,
                                                            speculate(own, context, k, factor, offset, min_prob).match_len)
        # The trie cannot extend a string past the depth: the brute force stops there too (len(s) < depth).
        assert (got.tokens, got.match_len) == (toks, m) and got.score == pytest.approx(score)


def test_remove_sequence_restores_the_tree_exactly():
    rng = random.Random(3)
    a = [rng.randrange(5) for _ in range(40)]
    b = [rng.randrange(5) for _ in range(40)]
    tree = SuffixTree(6)
    tree.add_sequence(a)
    nodes_a = tree.node_count()
    tree.add_sequence(b)
    tree.remove_sequence(b)
    assert tree.node_count() == nodes_a
    tree.remove_sequence(a)
    assert tree.node_count() == 1 and tree.root[1] == {}


def test_global_cache_is_fifo_bounded_and_serves_a_repeated_response():
    p = SuffixProposer(max_tree_depth=8, max_cached_requests=2, max_spec_factor=2.0)
    responses = [[10 + r, 20 + r, 30 + r, 40 + r, 50 + r] for r in range(3)]
    for seq, resp in enumerate(responses):
        p.speculate(seq, [1, 2, 3], 4)  # first step: the prompt
        p.speculate(seq, [1, 2, 3] + resp, 4)
        p.release(seq)
    assert len(p._responses) == 2 and p.active_requests() == 0
    assert p.global_tree.find([10]) is None  # the oldest response was evicted
    # A new request whose output starts like a cached response gets it from the global tree.
    d = p.speculate(99, [7, 7, 11, 21], 3)
    assert d.tokens == [31, 41, 51]
    d = p.speculate(98, [7, 7, 10, 20], 3)
    assert d.tokens == []


def test_request_tree_follows_the_sequence_and_prompt_repetition():
    p = SuffixProposer(max_tree_depth=16, max_cached_requests=0, max_spec_factor=2.0)
    prompt = [5, 6, 7, 8, 9, 1, 2]
    assert p.propose(1, prompt + [5, 6], 3, None, 0).draft_token_ids.tolist() == [7, 8, 9]
    assert p.propose(1, prompt + [5, 6, 7, 8], 2, None, 1).draft_token_ids.tolist() == [9, 1]
