"""Suffix decoding's speculation trees (``ProposalRequest.tree``; Arctic's ``use_tree_spec``) on both engines: the
nodes are the most probable continuations of the best match (a brute-force reference), in spec_decode.tree's order
with the most probable chain first; ``tree=False`` keeps the chain."""

import random

import pytest

from spec_decode.proposers import ProposalRequest, SuffixProposer, SuffixSettings
from spec_decode.proposers.suffix import SuffixDraft, SuffixTree, arctic_available, chain_first, speculate
from spec_decode.sampling import SamplingParams
from spec_decode.tree import check_tree, children, path_tokens

BACKENDS = ["python", pytest.param("arctic", marks=pytest.mark.skipif(not arctic_available(),
                                                                      reason="Arctic's suffix tree is not built"))]
# P = [1, 2, 3] is followed twice by [4, 5, 10] and once by [7, 8]; the context ends with P again.
PROMPT = [1, 2, 3, 4, 5, 10, 1, 2, 3, 4, 5, 10, 1, 2, 3, 7, 8, 6, 1, 2, 3]


def _count(seqs, s):
    n = len(s)
    return sum(1 for seq in seqs for i in range(len(seq) - n + 1) if seq[i : i + n] == s)


def _brute_tree_scores(seqs, depth, context, k, factor, offset, min_prob, max_match):
    """Per match length m, the score of the best tree: the sum of the ``allowed`` highest probabilities
    count(s + e) / count(s) >= min_prob over the continuations e of the context's last m tokens s (a continuation is
    never less probable than its own prefixes, so those nodes form a tree)."""
    alphabet = sorted({t for seq in seqs for t in seq})
    scores = {}
    for m in range(1, max_match + 1):
        s = context[len(context) - m :]
        if _count(seqs, s) == 0:
            break
        allowed = min(k, int(m * factor + offset))
        probs, frontier = [], [[]]
        while frontier:
            e = frontier.pop()
            for t in alphabet:
                if len(s) + len(e) + 1 <= depth and len(e) + 1 <= allowed:
                    p = _count(seqs, s + e + [t]) / _count(seqs, s)
                    if p > 0 and p >= min_prob:
                        probs.append(p)
                        frontier.append(e + [t])
        scores[m] = sum(sorted(probs, reverse=True)[:allowed])
    return scores


def _check_draft(d, seqs, context, k, factor, offset, min_prob, scores, rel):
    """``d`` is a valid tree of the brute-force best score, its nodes' probabilities the counts', most probable chain
    first (depth-first, the more probable child first)."""
    best = max(scores.values(), default=0.0)
    assert d.score == pytest.approx(best, rel=rel, abs=1e-9)
    if not d.token_ids:
        return
    assert scores[d.match_len] == pytest.approx(best, rel=rel)
    parents = check_tree(d.token_ids, d.parents)
    assert len(d.token_ids) <= min(k, int(d.match_len * factor + offset + 1e-6))
    s = context[len(context) - d.match_len :]
    for path, p in zip(path_tokens(d.token_ids, parents)[1:], d.probs):
        assert p == pytest.approx(_count(seqs, s + path) / _count(seqs, s), rel=rel) and p >= min_prob * (1 - rel)
    assert d.score == pytest.approx(sum(d.probs), rel=rel)
    for j, kids in enumerate(children(parents)):
        if kids:
            assert kids[0] == j  # row j's first child is node j (row j = node j - 1): depth-first order
            assert [d.probs[c] for c in kids] == sorted((d.probs[c] for c in kids), reverse=True)


def _random_case(rng, alphabet):
    depth = rng.choice([3, 5, 8])
    seqs = [[rng.randrange(alphabet) for _ in range(rng.randrange(5, 30))] for _ in range(rng.randrange(1, 4))]
    return depth, seqs


@pytest.mark.parametrize("seed", range(6))
def test_python_tree_is_the_most_probable_continuations_of_the_best_match(seed):
    rng = random.Random(seed)
    depth, seqs = _random_case(rng, 4)
    tree = SuffixTree(depth)
    for s in seqs:
        tree.add_sequence(s)
    for _ in range(5):
        context = [rng.randrange(4) for _ in range(rng.randrange(1, 10))]
        k, factor, offset, min_prob = (rng.choice([2, 4, 8]), rng.choice([0.5, 1.0, 2.0]), rng.choice([0, 1]),
                                       rng.choice([0.05, 0.1, 0.3]))
        got = speculate(tree, context, k, factor, offset, min_prob, use_tree=True)
        scores = _brute_tree_scores(seqs, depth, context, k, factor, offset, min_prob, min(depth, len(context)))
        _check_draft(got, seqs, context, k, factor, offset, min_prob, scores, 1e-9)
        own = SuffixTree(depth)  # a request's own trie, matched through its suffix nodes: the same tree
        for s in seqs:
            own.add_sequence(s)
        own.extend(context)
        via_nodes = speculate(own, context, k, factor, offset, min_prob, nodes=own.suffix_nodes(), use_tree=True)
        plain = speculate(own, context, k, factor, offset, min_prob, use_tree=True)
        assert (via_nodes.token_ids, via_nodes.parents) == (plain.token_ids, plain.parents)


@pytest.mark.skipif(not arctic_available(), reason="Arctic's suffix tree is not built")
@pytest.mark.parametrize("seed", range(6))
def test_arctic_tree_is_the_most_probable_continuations_of_the_best_match(seed):
    """Arctic's tree speculation (``use_tree_spec``) through the cache's engine: the same scores as the reference
    (it matches at most len(context) - 1 tokens), nodes reordered most probable chain first."""
    from spec_decode.proposers.suffix.cache import _ArcticEngine

    rng = random.Random(200 + seed)
    depth, seqs = _random_case(rng, 5)
    engine = _ArcticEngine(depth)
    tree = engine.new_tree()
    for i, s in enumerate(seqs):
        engine.add(tree, i, s)
    for _ in range(5):
        context = [rng.randrange(5) for _ in range(rng.randrange(2, 10))][-depth:]
        k, factor, offset, min_prob = (rng.choice([2, 4, 8]), rng.choice([0.5, 1.0, 2.0]), rng.choice([0, 1]),
                                       rng.choice([0.05, 0.1, 0.3]))
        got = engine.speculate(tree, context, False, k, factor, offset, min_prob, True)
        scores = _brute_tree_scores(seqs, depth, context, k, factor, offset, min_prob, len(context) - 1)
        _check_draft(got, seqs, context, k, factor, offset, min_prob, scores, 1e-5)


def test_chain_first_puts_the_most_probable_chain_first():
    # Arctic's pop order for two branches of equal probability: 4, 7, 5, 8, 9 (parents -1, -1, 0, 1, 2)
    d = chain_first(SuffixDraft([4, 7, 5, 8, 9], [0.5, 0.4, 0.5, 0.4, 0.5], 2.3, 3, [-1, -1, 0, 1, 2]))
    assert (d.token_ids, d.parents, d.probs) == ([4, 5, 9, 7, 8], [-1, 0, 1, -1, 3], [0.5, 0.5, 0.5, 0.4, 0.4])
    assert (d.score, d.match_len) == (2.3, 3)
    chain = SuffixDraft([1, 2, 3], [1.0, 0.5, 0.5], 2.0, 1, [-1, 0, 1])
    assert chain_first(chain) == chain


def _proposer(backend):
    return SuffixProposer(SuffixSettings(max_tree_depth=6, max_cached_requests=0, max_spec_factor=2.0,
                                         backend=backend))


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_repeated_prefix_with_two_continuations_gives_both_branches(backend):
    greedy = SamplingParams()
    (tree,) = _proposer(backend).propose([ProposalRequest(1, PROMPT, 5, greedy, 0, tree=True)])
    # [4, 5, 10] follows P with probability 1/2 per token, [7, 8] with 1/4: the more probable chain first
    assert tree.draft_token_ids.tolist() == [4, 5, 10, 7, 8] and tree.draft_probs is None
    assert tree.draft_parents is not None and tree.draft_parents.tolist() == [-1, 0, 1, -1, 3]
    assert tree.draft_parents.dtype == tree.draft_token_ids.dtype
    assert tree.score == pytest.approx(0.5 * 3 + 0.25 * 2)
    check_tree(tree.draft_token_ids.tolist(), tree.draft_parents.tolist())
    # tree=False: exactly the chain drafted before trees (here from the two-token match [2, 3], whose score ties)
    (chain,) = _proposer(backend).propose([ProposalRequest(1, PROMPT, 5, greedy, 0)])
    assert chain.draft_token_ids.tolist() == [4, 5, 10, 1] and chain.draft_parents is None
    assert chain.score == pytest.approx(2.0)
    # k bounds the nodes; a tree that is a chain carries no parents
    (small,) = _proposer(backend).propose([ProposalRequest(1, PROMPT, 3, greedy, 0, tree=True)])
    assert small.draft_token_ids.tolist() == [4, 5, 10] and small.draft_parents is None


@pytest.mark.parametrize("backend", BACKENDS)
def test_tree_steps_feed_the_cache_like_chain_steps(backend):
    """A sequence drafted with trees keeps its request tree in step with its ids, and earlier responses in the global
    tree branch the draft too."""
    p = SuffixProposer(SuffixSettings(max_tree_depth=8, max_spec_factor=4.0, backend=backend))
    p.speculate(1, [9], 4)
    p.release(1, [9, 1, 2, 3, 4, 5])
    p.speculate(2, [9], 4)
    p.release(2, [9, 1, 2, 3, 4, 6])
    greedy = SamplingParams()
    (d,) = p.propose([ProposalRequest(3, [8, 1, 2], 4, greedy, 0, tree=True)])
    tokens, parents = d.draft_token_ids.tolist(), d.draft_parents.tolist()
    assert tokens[:2] == [3, 4] and sorted(tokens[2:]) == [5, 6] and parents == [-1, 0, 1, 1]
    assert d.score == pytest.approx(3.0)
    (d,) = p.propose([ProposalRequest(3, [8, 1, 2, 3, 4], 2, greedy, 1, tree=True)])
    assert sorted(d.draft_token_ids.tolist()) == [5, 6] and d.draft_parents.tolist() == [-1, -1]
