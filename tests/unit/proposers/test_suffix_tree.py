"""spec_decode.proposers.suffix.tree (and Arctic's C++ tree): counts, probabilities and the chosen match equal a
brute-force reference."""

import random

import pytest

from spec_decode.proposers.suffix import SuffixTree, arctic_available, speculate


def _count(seqs, s):
    """Occurrences of the string s in a list of sequences (brute force)."""
    n = len(s)
    return sum(1 for seq in seqs for i in range(len(seq) - n + 1) if seq[i : i + n] == s)


def _brute_speculate(seqs, depth, context, k, factor, offset, min_prob, max_match=None, ties=None):
    """The reference speculation (ties between equally frequent children go to the smaller token id; ``ties``, a
    list, gets True appended whenever a walk met such a tie)."""
    best = ([], 0.0, 0, [])
    for m in range(1, (max_match or min(depth, len(context))) + 1):
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
            if ties is not None and sum(c == counts[tok] for c in counts.values()) > 1:
                ties.append(True)
            prob *= counts[tok] / _count(seqs, s)
            if prob < min_prob:
                break
            toks.append(tok)
            probs.append(prob)
            s.append(tok)
        score = sum(probs)
        if score > best[1] or (score == best[1] and score > 0):
            best = (toks, score, m, probs)
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
        k, factor, offset, min_prob = (rng.choice([2, 4, 8]), rng.choice([0.5, 1.0, 2.0]), rng.choice([0, 1]),
                                       rng.choice([0.05, 0.1, 0.3]))
        got = speculate(tree, context, k, factor, offset, min_prob)
        toks, score, m, _ = _brute_speculate(seqs, depth, context, k, factor, offset, min_prob)
        # A request's own trie: its current sequence is the context, and the known suffix nodes give the same answer.
        own = SuffixTree(depth)
        for s in seqs:
            own.add_sequence(s)
        own.extend(context)
        via_nodes = speculate(own, context, k, factor, offset, min_prob, nodes=own.suffix_nodes())
        plain = speculate(own, context, k, factor, offset, min_prob)
        assert (via_nodes.token_ids, via_nodes.match_len) == (plain.token_ids, plain.match_len)
        # The trie cannot extend a string past the depth: the brute force stops there too (len(s) < depth).
        assert (got.token_ids, got.match_len) == (toks, m) and got.score == pytest.approx(score)


exact_cases: list[int] = []


@pytest.mark.skipif(not arctic_available(),
                    reason="Arctic's suffix tree is not built (test_arctic_suffix_tree_is_installed fails)")
@pytest.mark.parametrize("seed", range(12))
def test_arctic_speculation_equals_brute_force(seed):
    """Arctic's C++ tree gives the brute-force draft, probabilities, score and match length (it matches at most
    len(context) - 1 tokens). Among equally frequent children it may pick another token than the reference's smallest
    id (so the walk may continue differently): there each drafted token must still be a most frequent child."""
    from arctic_inference.suffix_decoding._C import SuffixTree as NativeTree

    rng = random.Random(100 + seed)
    depth = rng.choice([3, 5, 8])
    seqs = [[rng.randrange(6) for _ in range(rng.randrange(5, 40))] for _ in range(rng.randrange(1, 4))]
    alphabet = sorted(set(t for seq in seqs for t in seq))
    tree = NativeTree(depth)
    for i, s in enumerate(seqs):
        tree.extend(i, s)
    checked_exact = 0
    for _ in range(5):
        context = [rng.randrange(6) for _ in range(rng.randrange(2, 10))][-depth:]
        k, factor, offset, min_prob = (rng.choice([2, 4, 8]), rng.choice([0.5, 1.0, 2.0]), rng.choice([0, 1]),
                                       rng.choice([0.05, 0.1, 0.3]))
        got = tree.speculate(context, k, factor, offset, min_prob, False)
        ties = []
        toks, score, m, probs = _brute_speculate(seqs, depth, context, k, factor, offset, min_prob,
                                                 max_match=len(context) - 1, ties=ties)
        if not ties:
            assert (list(got.token_ids), got.match_len) == (toks, m) if score > 0 else list(got.token_ids) == []
            assert got.score == pytest.approx(score, rel=1e-5) and list(got.probs) == pytest.approx(probs, rel=1e-5)
            checked_exact += 1
        # Always: the draft is a greedy walk from the context's last match_len tokens with the brute-force counts.
        s, prob = context[len(context) - got.match_len :], 1.0
        for tok, p in zip(got.token_ids, got.probs):
            counts = {t: _count(seqs, s + [t]) for t in alphabet}
            assert counts[tok] == max(counts.values()) > 0
            prob *= counts[tok] / _count(seqs, s)
            assert prob == pytest.approx(p, rel=1e-5) and p >= min_prob
            s = s + [tok]
        assert len(got.token_ids) <= min(k, int(got.match_len * factor + offset + 1e-6))
        assert got.score == pytest.approx(sum(got.probs), rel=1e-5)
    exact_cases.append(checked_exact)


@pytest.mark.skipif(not arctic_available(), reason="Arctic's suffix tree is not built")
def test_arctic_comparison_was_exact_in_most_cases():
    """Ties must not hide everything: most of the random cases above were compared exactly."""
    if len(exact_cases) < 12:
        pytest.skip("run together with test_arctic_speculation_equals_brute_force")
    assert sum(exact_cases) >= 20, exact_cases  # of 60


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
