"""Tree verification (torch path): a chain gives the chain samplers' output bit for bit, hand-made trees give their
known answers (greedy down a later branch, a rejected sibling then an accepted one, bonus at a leaf, padding), and
invalid parents are refused."""

import pytest
import torch

from spec_decode.verifier import rejection_sample, typical_acceptance_sample
from spec_decode.verifier.torch_impl import rejection_torch, typical_torch
from spec_decode.verifier.tree_sampler import tree_rejection_sample, tree_typical_sample
from spec_decode.verifier.tree_torch import tree_rejection_torch, tree_typical_torch

U_MAX = 1.0 - 2.0**-24  # the largest float32 below 1


def _chain_case(seed, b=16):
    g = torch.Generator().manual_seed(seed)
    k, v = int(torch.randint(0, 6, (1,), generator=g)), int(torch.randint(1, 9, (1,), generator=g))
    tp = torch.softmax(torch.randn(b, k + 1, v, generator=g) * 2, -1)
    dp = torch.softmax(torch.randn(b, k, v, generator=g) * 2, -1)
    ids = torch.randint(0, v, (b, k), generator=g)
    if k:
        ids[:, 0] = tp[:, 0].argmax(-1)  # some accepted by greedy rows
        ids[0, -1] = -1  # padded rows: -1 drafts at the end
        ids[1, k // 2:] = -1
        dp[2] = tp[2, :k]  # p == q
    u = torch.rand(b, k, generator=g)
    u[3] = U_MAX
    e = torch.empty(b, v).exponential_(generator=g)
    greedy = torch.rand(b, generator=g) < 0.3
    parents = torch.arange(-1, k - 1).expand(b, k).contiguous()
    return tp, dp, ids, parents, u, e, greedy


@pytest.mark.parametrize("seed", range(12))
def test_a_chain_gives_the_chain_samplers_output_bit_for_bit(seed):
    tp, dp, ids, parents, u, e, greedy = _chain_case(seed)
    k = ids.shape[1]
    for probs in (dp, None):
        out, path = tree_rejection_torch(tp, ids, parents, probs, u, e, greedy)
        want = rejection_torch(tp, ids, probs, u, e, greedy)
        assert torch.equal(out, want), (seed, probs is None)
        n_accepted = (want >= 0).sum(1, keepdim=True) - 1
        nodes = torch.arange(k).expand_as(path)
        assert torch.equal(path, torch.where(nodes < n_accepted, nodes, -1))
    for eps, alpha in ((0.09, 0.3), (0.0, 0.0), (0.5, 1.0)):
        out, _ = tree_typical_torch(tp, ids, parents, eps, alpha, e, greedy)
        assert torch.equal(out, typical_torch(tp, ids, eps, alpha, e, greedy)), (seed, eps, alpha)


def test_public_api_on_a_chain_equals_the_chain_api_for_the_same_seeds():
    tp, dp, ids, parents, _, _, greedy = _chain_case(5)
    seeds = torch.arange(len(tp)) * 7 + 1
    for probs in (dp, None):
        out, _ = tree_rejection_sample(tp, ids, parents, probs, seeds=seeds, is_greedy=greedy)
        assert torch.equal(out, rejection_sample(tp, ids, probs, seeds=seeds, is_greedy=greedy))
    out, _ = tree_typical_sample(tp, ids, parents, seeds=seeds, is_greedy=greedy)
    assert torch.equal(out, typical_acceptance_sample(tp, ids, seeds=seeds, is_greedy=greedy))


def _rows(*dists):
    return torch.tensor(dists, dtype=torch.float32)[None]


def _t(*rows):
    return torch.tensor(rows, dtype=torch.int64)


V5 = 5
UNIFORM5 = [0.2] * V5
EXP_ONE_SMALL = torch.ones(V5, V5) - torch.eye(V5) * (1 - 1e-6)  # row j: E tiny at j (j wins unless excluded)


@pytest.mark.parametrize("sampler", ["rejection", "typical"])
def test_greedy_follows_the_argmax_down_a_branch_that_is_not_the_first(sampler):
    """Root children 1 and 3 (3 the argmax); node 1's children 0 and 4 (4 the argmax of node 1's row)."""
    tp = _rows([0.1, 0.2, 0.1, 0.5, 0.1], UNIFORM5, [0.1, 0.1, 0.1, 0.1, 0.6], UNIFORM5, [0.1, 0.1, 0.7, 0.0, 0.1])
    ids, parents = _t([1, 3, 0, 4]), _t([-1, -1, 1, 1])
    greedy = torch.tensor([True])
    if sampler == "rejection":
        out, path = tree_rejection_torch(tp, ids, parents, None, torch.zeros(1, 4), torch.ones(1, V5), greedy)
    else:
        out, path = tree_typical_torch(tp, ids, parents, 0.09, 0.3, torch.ones(1, V5), greedy)
    assert out.tolist() == [[3, 4, 2, -1, -1]] and path.tolist() == [[1, 3, -1, -1]]


def test_a_rejected_first_sibling_then_an_accepted_second_without_draft_probs():
    """p = [0, .5, .5, 0, 0]: node 0 (token 2) rejected at u = .9 (S becomes .5), node 1 (token 1) accepted at
    u = .9 (.45 < .5); node 1 is a leaf: bonus from its row, one-hot at 4."""
    tp = _rows([0, 0.5, 0.5, 0, 0], UNIFORM5, [0, 0, 0, 0, 1.0])
    out, path = tree_rejection_torch(tp, _t([2, 1]), _t([-1, -1]), None, torch.tensor([[0.9, 0.9]]),
                                     torch.ones(1, V5), torch.tensor([False]))
    assert out.tolist() == [[1, 4, -1]] and path.tolist() == [[1, -1]]


def test_a_rejected_first_sibling_then_an_accepted_second_with_draft_probs():
    """p = [0, .5, .5, 0, 0], q = [0, .2, .8, 0, 0]: token 2 rejected at u = .9 (.72 >= .5); the residual is
    [0, .3, 0, 0, 0] / .3 and q without token 2 is [0, 1, 0, 0, 0]: token 1 is accepted (with probability 1 up to
    float32 rounding of the draft's remaining mass 1 - .8)."""
    tp = _rows([0, 0.5, 0.5, 0, 0], UNIFORM5, [0, 0, 0, 0, 1.0])
    q = torch.tensor([0, 0.2, 0.8, 0, 0]).expand(1, 2, V5).contiguous()
    out, path = tree_rejection_torch(tp, _t([2, 1]), _t([-1, -1]), q, torch.tensor([[0.9, 0.9]]),
                                     torch.ones(1, V5), torch.tensor([False]))
    assert out.tolist() == [[1, 4, -1]] and path.tolist() == [[1, -1]]


def test_rejected_siblings_are_never_the_recovered_token():
    """p uniform on {0, 1, 2}; children 0 and 1 both rejected at u = U_MAX: the recovered token is 2 whatever E."""
    tp = _rows([1 / 3, 1 / 3, 1 / 3, 0, 0], UNIFORM5, UNIFORM5)
    for e in EXP_ONE_SMALL:
        out, path = tree_rejection_torch(tp, _t([0, 1]), _t([-1, -1]), None, torch.full((1, 2), U_MAX), e[None],
                                         torch.tensor([False]))
        assert out.tolist() == [[2, -1, -1]] and path.tolist() == [[-1, -1]]


def test_an_exhausted_residual_falls_back_to_p_and_a_zero_probability_child_is_never_accepted():
    """p = [.25, .25, 0, 0, 0] (unnormalised); children 0 and 1 rejected at U_MAX leave no residual, child 2 has
    p = 0: rejected even at u = 0; the recovered token comes from p (0 or 1), never 2. As the chain sampler."""
    tp = _rows([0.25, 0.25, 0, 0, 0], UNIFORM5, UNIFORM5, UNIFORM5)
    for e in EXP_ONE_SMALL:
        out, _ = tree_rejection_torch(tp, _t([0, 1, 2]), _t([-1, -1, -1]), None, torch.tensor([[U_MAX, U_MAX, 0.0]]),
                                      e[None], torch.tensor([False]))
        assert out[0, 0] in (0, 1) and out[0, 1:].tolist() == [-1, -1, -1]


def test_a_bonus_token_at_a_leaf_comes_from_the_leaf_s_row():
    """Root child 0 (token 3, p = 1) accepted; its child 1 (token 2, p = 1) accepted; node 1 is a leaf."""
    tp = _rows([0, 0, 0, 1.0, 0], [0, 0, 1.0, 0, 0], [0.25, 0.25, 0, 0.25, 0.25])
    e = torch.tensor([[5.0, 5.0, 1e-4, 5.0, 1e-3]])  # 2 has p = 0 there: 4 wins
    out, path = tree_rejection_torch(tp, _t([3, 2]), _t([-1, 0]), None, torch.full((1, 2), 0.5), e,
                                     torch.tensor([False]))
    assert out.tolist() == [[3, 2, 4]] and path.tolist() == [[0, 1]]


def test_padding_nodes_are_ignored_and_a_row_padded_at_its_end_gets_what_it_gets_alone():
    g = torch.Generator().manual_seed(4)
    tp = torch.softmax(torch.randn(1, 4, 7, generator=g), -1)
    dp = torch.softmax(torch.randn(1, 3, 7, generator=g), -1)
    ids, parents = _t([2, -1, 5]), _t([-1, -1, 0])  # a padding node between real ones
    big_tp = torch.cat([tp, torch.softmax(torch.randn(1, 3, 7, generator=g), -1)], 1)
    big_ids, big_par = torch.cat([ids, _t([-1, -1, -1])], 1), torch.cat([parents, _t([-1, -1, -1])], 1)
    big_dp = torch.cat([dp, torch.zeros(1, 3, 7)], 1)
    for seed in range(20):
        s = torch.tensor([seed])
        out, path = tree_rejection_sample(tp, ids, parents, dp, seeds=s)
        big_out, big_path = tree_rejection_sample(big_tp, big_ids, big_par, big_dp, seeds=s)
        assert big_out[0, :4].tolist() == out[0].tolist() and (big_out[0, 4:] == -1).all()
        assert big_path[0, :3].tolist() == path[0].tolist() and 1 not in path[0].tolist()
        t_out, _ = tree_typical_sample(tp, ids, parents, seeds=s)
        assert torch.equal(tree_typical_sample(big_tp, big_ids, big_par, seeds=s)[0][0, :4], t_out[0])
    empty = _t([-1, -1, -1])  # a row of padding only: the bonus token from row 0
    out, path = tree_rejection_sample(tp, empty, empty, is_greedy=torch.tensor([True]))
    assert out.tolist() == [[int(tp[0, 0].argmax()), -1, -1, -1]] and path.tolist() == [[-1, -1, -1]]


def test_typical_takes_the_deepest_passing_path_lowest_index_on_ties():
    """Nodes 0 and 1 pass at the root; node 2 (below 0) fails, node 3 (below 1) passes: the path is [1, 3], and
    node 3 is a leaf (bonus race). Node 4 (below 3) would fail: then the final token is argmax of node 3's row."""
    sharp = [0.02, 0.48, 0.48, 0.01, 0.01]
    tp = _rows(sharp, [0.97, 0.01, 0.01, 0.0, 0.01], sharp, UNIFORM5, [0.05, 0.05, 0.05, 0.8, 0.05], UNIFORM5)
    e = torch.tensor([[1.0, 1.0, 1.0, 1.0, 1e-3]])
    ids, parents = _t([1, 2, 3, 2, 0]), _t([-1, -1, 0, 1, 3])
    out, path = tree_typical_torch(tp, ids, parents, 0.09, 0.3, e, torch.tensor([False]))
    assert path.tolist() == [[1, 3, -1, -1, -1]] and out.tolist() == [[2, 2, 3, -1, -1, -1]]
    ids[0, 4] = -1  # node 3 is a leaf now: the bonus race on its row (4 has the smallest E)
    out, path = tree_typical_torch(tp, ids, parents, 0.09, 0.3, e, torch.tensor([False]))
    assert path.tolist() == [[1, 3, -1, -1, -1]] and out.tolist() == [[2, 2, 4, -1, -1, -1]]
    tie = _rows(sharp, [0.1, 0.1, 0.6, 0.1, 0.1], [0.1, 0.1, 0.6, 0.1, 0.1], UNIFORM5, UNIFORM5)
    out, path = tree_typical_torch(tie, _t([1, 2, 2, 2]), _t([-1, -1, 0, 1]), 0.09, 0.3, e, torch.tensor([False]))
    assert path.tolist() == [[0, 2, -1, -1]] and out[0, :2].tolist() == [1, 2]


P3 = torch.full((1, 4, 6), 1 / 6)
IDS3 = _t([1, 2, 3])


@pytest.mark.parametrize("parents, match", [
    (_t([-1, 0, 2]), r"parent must lie in \[-1, i\)"),
    (_t([-2, 0, 1]), r"parent must lie in \[-1, i\)"),
    (_t([-1, 0, 0]).int(), "draft_parents dtype must be int64"),
    (_t([-1, 0]), r"draft_parents must be \[B, n\]"),
    ([-1, 0, 1], "draft_parents must be a"),
])
def test_invalid_parents_are_value_errors_naming_draft_parents(parents, match):
    for call in (lambda: tree_rejection_sample(P3, IDS3, parents), lambda: tree_typical_sample(P3, IDS3, parents)):
        with pytest.raises(ValueError, match=match):
            call()


def test_a_parent_that_is_a_padding_node_and_repeated_siblings_are_refused():
    with pytest.raises(ValueError, match="draft_parents: a real node's parent must be a real node"):
        tree_rejection_sample(P3, _t([1, -1, 3]), _t([-1, -1, 1]))
    with pytest.raises(ValueError, match="draft_parents: siblings .* distinct tokens; batch rows \\[0\\]"):
        tree_rejection_sample(P3, _t([1, 2, 2]), _t([-1, 0, 0]))
    tree_rejection_sample(P3, _t([1, 2, 2]), _t([-1, -1, 0]))  # cousins may repeat a token
    tree_rejection_sample(P3, _t([1, -1, -1]), _t([-1, 7, -5]))  # padding nodes' parents are not read


def test_other_inputs_are_checked_as_by_the_chain_api():
    with pytest.raises(ValueError, match="draft_token_ids must be"):
        tree_rejection_sample(P3, IDS3[:, :2], _t([-1, 0]))
    with pytest.raises(ValueError, match="backend"):
        tree_rejection_sample(P3, IDS3, _t([-1, 0, 1]), backend="cuda")
    with pytest.raises(ValueError, match="posterior_alpha"):
        tree_typical_sample(P3, IDS3, _t([-1, 0, 1]), posterior_alpha=-1.0)
    with pytest.raises(ValueError, match="NaN"):
        tree_rejection_sample(P3 * float("nan"), IDS3, _t([-1, 0, 1]))
