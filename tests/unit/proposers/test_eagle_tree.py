"""EAGLE's dynamic draft trees (proposers/eagle/tree.py): each node among its parent's top-k given its own path,
joint probabilities and the rerank as EAGLE-2 computes them, a round's trees as each request's alone, and the head's
contexts left holding only committed pairs."""

import pytest
import torch

from spec_decode.proposers import ProposalRequest
from spec_decode.proposers.eagle.tree import ancestor_mask
from spec_decode.proposers.speculators import SpeculatorSettings
from spec_decode.proposers.speculators.candidate_tree import Candidate
from spec_decode.sampling import SamplingParams
from spec_decode.tree import check_tree, path_tokens
from tests.helpers import save_tiny_eagle
from tests.speculator_checkpoints.eagle import write_eagle3
from tests.unit.proposers.test_eagle import HEADS, PROPOSER, WIDTH


@pytest.fixture(scope="module")
def head_dirs(tiny_lm, tmp_path_factory):
    """The heads of tests/unit/proposers/test_eagle.py: EAGLE-1 (authors' layout) and EAGLE-3, random weights."""
    root = tmp_path_factory.mktemp("tree-heads")
    return {"eagle": save_tiny_eagle(tiny_lm, root / "eagle"),
            "eagle3": write_eagle3(root / "eagle3", 32, 97, 4, 2, 64, 48, layer_ids=[0, 1, 1])}


def _proposer(method, head_dirs, tiny_dir, min_token_prob=0.0, **tree):
    settings = SpeculatorSettings(speculator_path=str(head_dirs[method]), target_model_path=str(tiny_dir),
                                  device="cpu", speculator_min_token_prob=min_token_prob, **tree)
    p = PROPOSER[method].from_config(settings, {})
    assert p is not None
    return p


@torch.no_grad()
def _distribution(model, ids, states, path):
    """The head's draft distribution [N] after the path ``path`` (target ids) by plain recomputation: the pairs of the
    target's states, then each path token's pair (the head's own previous output, the token), all run again."""
    n, first = len(ids) - 1, len(ids) - 1 - len(states)
    zs = [model.pair_inputs(model.features(states), torch.tensor(ids[first + 1 :]))]
    pos = [torch.arange(first, n)]
    a = None
    for i in range(len(path) + 1):
        z, p = torch.cat(zs)[None], torch.cat(pos)[None]
        a = model.layer(z, p, torch.ones(z.shape[1], z.shape[1], dtype=torch.bool).tril()[None, None])[0][0, -1:]
        if i < len(path):
            zs.append(model.pair_inputs(a, torch.tensor([path[i]])))
            pos.append(torch.tensor([n + i]))
    return torch.softmax(model.logits(a)[0].double(), -1)


def test_the_tree_mask_sees_the_committed_pairs_the_ancestors_and_itself():
    cands = [Candidate(-1, 5, 0.6, 1), Candidate(-1, 7, 0.3, 1), Candidate(0, 9, 0.5, 2), Candidate(1, 2, 0.2, 2)]
    mask = ancestor_mask(3, {0: 0, 1: 1}, cands, [2, 3])  # 3 committed, pairs of nodes 0 and 1 drafted, then 2 and 3
    assert mask.tolist() == [[True] * 3 + [True, False] + [True, False],
                             [True] * 3 + [False, True] + [False, True]]


@pytest.mark.parametrize("method", HEADS)
@pytest.mark.parametrize(("k", "min_prob", "top_k"), [(8, 0.0, 4), (3, 0.0, 2), (8, 0.01, 3)])
def test_each_node_is_among_its_parent_s_top_k_given_its_path_and_the_tree_keeps_the_most_probable(
        head_dirs, tiny_dir, method, k, min_prob, top_k):
    """draft_tree: at most k nodes, no draft_probs; each node's token is among the top_k of the head's distribution
    after its path (recomputed without caches: the tree attention is the path's causal attention); its joint
    probability is the product along its path and passes the threshold; the score is their sum."""
    p = _proposer(method, head_dirs, tiny_dir, min_prob, tree_top_k=top_k)
    g = torch.Generator().manual_seed(k + top_k)
    ids = torch.randint(0, 97, (9,), generator=g).tolist()
    states = torch.randn(5, WIDTH[method], generator=g) * 3
    (tree,) = p.propose([ProposalRequest(1, ids, k, SamplingParams(), 0, states, tree=True)])
    drafts = tree.draft_token_ids.tolist()
    parents = tree.draft_parents.tolist() if tree.draft_parents is not None else list(range(-1, len(drafts) - 1))
    assert tree.draft_probs is None and 0 < len(drafts) <= k
    check_tree(drafts, parents)
    kept = p.vocab.token_ids.tolist()
    joints = []
    for path in path_tokens(drafts, parents)[1:]:
        dist = _distribution(p.model, ids, states, path[:-1])
        top = [kept[i] for i in torch.topk(dist, top_k).indices.tolist()]
        assert path[-1] in top, path
        before = joints[parents[len(joints)]] if parents[len(joints)] >= 0 else 1.0
        joints.append(before * float(dist[kept.index(path[-1])]))
    assert min(joints) >= min_prob and tree.score == pytest.approx(sum(joints), rel=1e-4)
    if min_prob == 0.0:
        assert len(drafts) == k
    if k == 8 and top_k == 4:  # these random heads are flat enough that eight nodes branch
        assert tree.draft_parents is not None
    # the context holds the committed pairs only: the next step drafts as after a chain
    other = _proposer(method, head_dirs, tiny_dir, min_prob)
    other.propose([ProposalRequest(1, ids, k, SamplingParams(), 0, states)])
    step = ProposalRequest(1, [*ids, drafts[0]], 4, SamplingParams(), 1, states[-1:] * 0.5)
    assert p.propose([step])[0].draft_token_ids.tolist() == other.propose([step])[0].draft_token_ids.tolist()


@pytest.mark.parametrize("method", HEADS)
def test_a_round_s_trees_and_chains_draft_as_each_would_alone(head_dirs, tiny_dir, method):
    p = _proposer(method, head_dirs, tiny_dir)
    g = torch.Generator().manual_seed(3)
    reqs = [ProposalRequest(s, torch.randint(0, 97, (5 + 3 * s,), generator=g).tolist(), 2 + s % 5,
                            SamplingParams() if s % 3 else SamplingParams(temperature=1.0, seed=s), 0,
                            torch.randn(1 + s, WIDTH[method], generator=g), tree=s % 2 == 0) for s in range(7)]
    together = p.propose(reqs)
    for r, t in zip(reqs, together):
        alone = _proposer(method, head_dirs, tiny_dir).propose([r])[0]
        assert t.draft_token_ids.tolist() == alone.draft_token_ids.tolist()
        assert (t.draft_parents is None) == (alone.draft_parents is None)
        if t.draft_parents is not None:
            assert t.draft_parents.tolist() == alone.draft_parents.tolist() and t.draft_probs is None
        assert len(t.draft_token_ids) <= r.k


@pytest.mark.parametrize("method", HEADS)
def test_tree_depth_bounds_the_levels_and_top_k_one_is_a_chain(head_dirs, tiny_dir, method):
    ids, states = [4, 8, 15, 16], torch.randn(2, WIDTH[method]) * 3
    request = ProposalRequest(1, ids, 8, SamplingParams(), 0, states, tree=True)
    shallow = _proposer(method, head_dirs, tiny_dir, tree_depth=2).propose([request])[0]
    assert max(len(p) for p in path_tokens(shallow.draft_token_ids.tolist(), shallow.draft_parents.tolist())) == 2
    assert len(shallow.draft_token_ids) == 8  # 4 + 4 x 4 candidates, the 8 most probable kept
    narrow = _proposer(method, head_dirs, tiny_dir, tree_top_k=1).propose([request])[0]
    chain = _proposer(method, head_dirs, tiny_dir).propose([ProposalRequest(1, ids, 8, SamplingParams(), 0,
                                                                            states)])[0]
    assert narrow.draft_parents is None and narrow.draft_token_ids.tolist() == chain.draft_token_ids.tolist()
    with pytest.raises(ValueError, match="tree_top_k"):
        SpeculatorSettings(tree_top_k=0)
    with pytest.raises(ValueError, match="tree_depth"):
        SpeculatorSettings(tree_depth=-1)


@pytest.mark.parametrize("method", HEADS)
def test_a_request_s_tree_top_k_and_tree_depth_draft_the_tree_of_that_config(head_dirs, tiny_dir, method):
    """The per-request shape (ProposalRequest.tree_top_k / tree_depth, the wire's inputs of those names) replaces the
    config's: the same tree as a proposer configured with them, in a round beside a request of the config's shape."""
    g = torch.Generator().manual_seed(5)
    ids, states = torch.randint(0, 97, (7,), generator=g).tolist(), torch.randn(3, WIDTH[method], generator=g) * 3
    plain = ProposalRequest(1, ids, 8, SamplingParams(), 0, states, tree=True)
    shaped = ProposalRequest(2, ids, 8, SamplingParams(), 0, states, tree=True, tree_top_k=2, tree_depth=3)
    default, asked = _proposer(method, head_dirs, tiny_dir).propose([plain, shaped])
    configured = _proposer(method, head_dirs, tiny_dir, tree_top_k=2, tree_depth=3).propose([plain])[0]
    assert asked.draft_token_ids.tolist() == configured.draft_token_ids.tolist()
    assert asked.draft_parents.tolist() == configured.draft_parents.tolist()
    assert max(len(p) for p in path_tokens(asked.draft_token_ids.tolist(), asked.draft_parents.tolist())) <= 3
    assert default.draft_token_ids.tolist() == _proposer(method, head_dirs, tiny_dir).propose(
        [plain])[0].draft_token_ids.tolist()
