"""spec_decode.proposers.draft_lm: a round's drafts as each sequence's alone, and the confidence rule that ends a
step's drafts (draft_min_token_prob)."""

from dataclasses import replace

import pytest
import torch

from spec_decode.engine.kv_cache import CachedCausalLM
from spec_decode.proposers import DraftLMSettings, DraftModelProposer, ProposalRequest
from spec_decode.sampling import SamplingParams
from tests.helpers import assert_cut_by_rule, confidence_rule


def _requests():
    g = torch.Generator().manual_seed(3)
    return [ProposalRequest(s, torch.randint(0, 97, (4 + s,), generator=g).tolist(), 4,
                            SamplingParams() if s % 2 else SamplingParams(temperature=1.0, seed=s), 0)
            for s in range(40)]


def test_a_step_drafts_while_its_confidence_holds_and_scores_its_drafts(tiny_lm):
    """With min_token_prob = t, each proposal is the prefix of the every-slot proposal up to the first slot i where
    (product of the drafts' probabilities before i) x (slot i's top probability) < t; its score is the sum of its
    drafts' running probabilities."""
    lm = CachedCausalLM(tiny_lm)
    every = DraftModelProposer(lm, None, 0.0).propose(_requests())
    for r in _requests():
        lm.release(r.seq_id)
    assert all(len(p.draft_token_ids) == 4 for p in every)
    running, confidence = confidence_rule(every)
    t = float(torch.stack([c[1] for c in confidence]).median())  # about half the rows stop after one draft
    cut = DraftModelProposer(lm, None, t).propose(_requests())
    lengths = assert_cut_by_rule(every, cut, running, confidence, t, atol=1e-5, rtol=1e-4)
    assert len(set(lengths)) > 1  # the rule cut some rows, not all
    with pytest.raises(Exception, match="draft_min_token_prob"):
        DraftLMSettings(draft_min_token_prob=-0.1)


# -- branching trees (proposers/draft_lm/tree.py) -------------------------------------------------------------------


def test_a_node_branches_into_its_top_k_only_where_the_draft_is_unsure():
    from spec_decode.proposers.draft_lm.tree import branch_children

    assert branch_children([0.9, 0.05], [7, 3], 1.0, 0.8, 0.0) == [(0.9, 7)]  # sure: one child
    assert branch_children([0.5, 0.3], [7, 3], 0.5, 0.8, 0.0) == [(0.25, 7), (0.15, 3)]  # unsure: both
    assert branch_children([0.5, 0.3], [7, 3], 0.5, 0.8, 0.2) == [(0.25, 7)]  # the threshold on joints


@pytest.mark.parametrize(("k", "branch_prob", "min_prob"), [(6, 0.9, 0.0), (3, 1.0, 0.0), (8, 0.6, 0.01)])
def test_a_tree_branches_where_the_draft_is_unsure_into_its_top_k_given_each_path(tiny_lm, k, branch_prob, min_prob):
    """draft_tree: at most k nodes, no draft_probs; a node's children are its path's most probable token when that
    one's probability is >= branch_prob, else its tree_top_k most probable (recomputed by a plain forward over the
    path); joints are the products along the paths and pass the threshold; the score is their sum."""
    from spec_decode.tree import check_tree, path_tokens

    p = DraftModelProposer(CachedCausalLM(tiny_lm), None, min_prob, tree_top_k=3, branch_prob=branch_prob)
    ids = [5, 17, 3, 9, 44]
    (tree,) = p.propose([ProposalRequest(1, ids, k, SamplingParams(), 0, tree=True)])
    drafts = tree.draft_token_ids.tolist()
    parents = tree.draft_parents.tolist() if tree.draft_parents is not None else list(range(-1, len(drafts) - 1))
    assert tree.draft_probs is None and 0 < len(drafts) <= k
    check_tree(drafts, parents)
    joints = []
    with torch.no_grad():
        for node, path in enumerate(path_tokens(drafts, parents)[1:]):
            dist = torch.softmax(tiny_lm(torch.tensor([ids + path[:-1]])).logits[0, -1].double(), -1)
            top = torch.topk(dist, 3)
            allowed = top.indices[:1] if top.values[0] >= branch_prob else top.indices
            assert path[-1] in allowed.tolist(), (node, path)
            before = joints[parents[node]] if parents[node] >= 0 else 1.0
            joints.append(before * float(dist[path[-1]]))
    assert min(joints) >= min_prob and tree.score == pytest.approx(sum(joints), rel=1e-4)
    if branch_prob == 1.0:  # every node unsure: the first level holds the 3 best
        assert parents == [-1, -1, -1]


def test_a_round_s_trees_and_chains_draft_as_alone_and_trees_that_never_branch_are_chains(tiny_lm):
    reqs = [replace(r, k=2 + r.seq_id % 5, tree=r.seq_id % 2 == 0) for r in _requests()[:8]]
    lm = CachedCausalLM(tiny_lm)
    together = DraftModelProposer(lm, None, 0.0, tree_top_k=2, branch_prob=0.7).propose(reqs)
    for r, t in zip(reqs, together):
        alone = DraftModelProposer(CachedCausalLM(tiny_lm), None, 0.0, tree_top_k=2, branch_prob=0.7).propose([r])[0]
        assert t.draft_token_ids.tolist() == alone.draft_token_ids.tolist()
        assert (t.draft_parents is None) == (alone.draft_parents is None)
        assert (t.draft_probs is None) == (r.tree and r.params.is_greedy)  # a sampled request drafts a chain
    never = DraftModelProposer(CachedCausalLM(tiny_lm), None, 0.0, tree_top_k=2, branch_prob=0.0)
    greedy = [replace(r, params=SamplingParams()) for r in reqs]
    chains = DraftModelProposer(CachedCausalLM(tiny_lm), None, 0.0).propose([replace(r, tree=False) for r in greedy])
    for t, c in zip(never.propose(greedy), chains):
        assert t.draft_parents is None and t.draft_token_ids.tolist() == c.draft_token_ids.tolist()
    with pytest.raises(Exception, match="draft_tree_top_k"):
        DraftLMSettings(draft_tree_top_k=0)
    with pytest.raises(Exception, match="draft_branch_prob"):
        DraftLMSettings(draft_branch_prob=1.5)


def test_a_request_s_tree_top_k_and_tree_depth_shape_its_tree(tiny_lm):
    """tree_top_k / tree_depth of a request replace draft_tree_top_k and the depth (k) for that request alone: its
    tree is the one a proposer configured with that width drafts, cut at that depth; tree_top_k 1 is the chain."""
    from spec_decode.tree import path_tokens

    (r,) = [replace(r, k=6, tree=True, params=SamplingParams()) for r in _requests()[:1]]
    wide = replace(r, seq_id=r.seq_id + 100, tree_top_k=4)
    p = DraftModelProposer(CachedCausalLM(tiny_lm), None, 0.0, tree_top_k=2, branch_prob=1.0)
    mine, asked = p.propose([r, wide])
    configured = DraftModelProposer(CachedCausalLM(tiny_lm), None, 0.0, tree_top_k=4, branch_prob=1.0).propose([r])[0]
    assert asked.draft_token_ids.tolist() == configured.draft_token_ids.tolist()
    assert asked.draft_parents.tolist() == configured.draft_parents.tolist()
    assert mine.draft_parents.tolist() != asked.draft_parents.tolist()  # 2 children per node against 4
    shallow = p.propose([replace(r, seq_id=7, tree_depth=2)])[0]
    assert max(len(q) for q in path_tokens(shallow.draft_token_ids.tolist(), shallow.draft_parents.tolist())) == 2
    chain = p.propose([replace(r, seq_id=8, tree=False)])[0]
    one = p.propose([replace(r, seq_id=9, tree_top_k=1)])[0]
    assert one.draft_parents is None and one.draft_token_ids.tolist() == chain.draft_token_ids.tolist()
