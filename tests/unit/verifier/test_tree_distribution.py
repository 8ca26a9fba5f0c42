"""Tree rejection sampling is lossless: chi-square tests that the emitted tokens follow the target's law, on small
vocabularies, with three branches at the root and two below each (depth 2), in breadth-first and depth-first node
order: the first token ~ p(root); given that the first token is node c's token (c accepted), the second ~ p(c); given
two accepted nodes ending at token s, the third ~ p(s). Drafts without probabilities (any fixed tokens, here random
distinct ones per row) and drafts whose siblings are drawn WITHOUT replacement from q (SpecInfer / RSD)."""

import pytest
import torch

from spec_decode.verifier.tree_sampler import tree_rejection_sample
from tests.helpers import assert_token_law, random_dist

V, N = 6, 40000
ROOT_KIDS, KIDS = 3, 2
# (parent of each node) for the two layouts; the root's children are the nodes with parent -1, in index order
ORDERS = {
    "bfs": [-1, -1, -1, 0, 0, 1, 1, 2, 2],
    "dfs": [-1, 0, 0, -1, 3, 3, -1, 6, 6],
}


def _without_replacement(q: torch.Tensor, m: int, g: torch.Generator) -> torch.Tensor:
    """[R, m] distinct tokens per row of q [R, V], drawn one after another from q without the ones already drawn."""
    return torch.multinomial(q, m, replacement=False, generator=g)


def _case(order: str, with_probs: bool, seed: int):
    """N rows of one tree layout: tokens, parents, target rows (row 0: p_root; a depth-1 node with token t: p1[t];
    a depth-2 node with token s: p2[s]) and, with_probs, the draft rows (root children: q_root; the children of a
    node with token t: q1[t]), the tokens drawn from them without replacement."""
    g = torch.Generator().manual_seed(seed)
    p_root, p1, p2 = random_dist(g, V, sharp=2.0), random_dist(g, V, V, sharp=2.0), random_dist(g, V, V, sharp=2.0)
    q_root, q1 = random_dist(g, V, sharp=1.3), random_dist(g, V, V, sharp=1.3)
    q_root[p_root.argmax()] = 0.0  # the target's favourite can only come from the residual at the root
    q_root /= q_root.sum()
    parents = torch.tensor(ORDERS[order])
    roots = (parents == -1).nonzero()[:, 0]
    if with_probs:
        first = _without_replacement(q_root.expand(N, V), ROOT_KIDS, g)  # [N, 3]
        second = _without_replacement(q1[first].reshape(-1, V), KIDS, g).reshape(N, ROOT_KIDS, KIDS)
    else:
        first = torch.rand(N, V, generator=g).argsort(-1)[:, :ROOT_KIDS]
        second = torch.rand(N, ROOT_KIDS, V, generator=g).argsort(-1)[..., :KIDS]
    n = len(parents)
    ids = torch.empty(N, n, dtype=torch.int64)
    tp = torch.empty(N, n + 1, V)
    dp = torch.empty(N, n, V)
    tp[:, 0] = p_root
    for c, node in enumerate(roots.tolist()):
        ids[:, node] = first[:, c]
        tp[:, node + 1] = p1[first[:, c]]
        dp[:, node] = q_root
        kids = (parents == node).nonzero()[:, 0].tolist()
        for j, kid in enumerate(kids):
            ids[:, kid] = second[:, c, j]
            tp[:, kid + 1] = p2[second[:, c, j]]
            dp[:, kid] = q1[first[:, c]]
    return ids, parents.expand(N, n).contiguous(), tp, dp if with_probs else None, (p_root, p1, p2)


@pytest.mark.parametrize("order", ["bfs", "dfs"])
@pytest.mark.parametrize("with_probs", [False, True], ids=["one_hot", "draft_probs"])
def test_emitted_tokens_follow_the_target_law(order, with_probs):
    case = 2 * with_probs + (order == "dfs")
    ids, parents, tp, dp, (p_root, p1, p2) = _case(order, with_probs, seed=7 + case)
    out, path = tree_rejection_sample(tp, ids, parents, dp, seeds=torch.arange(N) + N * case)
    assert_token_law(out[:, 0].numpy(), p_root.double().numpy(), V, "first")
    tested = {1: 0, 2: 0}
    for t in range(V):  # first token t accepted as a node: the second token ~ p1[t]
        rows = (out[:, 0] == t) & (path[:, 0] >= 0)
        if int(rows.sum()) >= 400:
            assert_token_law(out[rows, 1].numpy(), p1[t].double().numpy(), V, ("second", t))
            tested[1] += 1
        rows = (path[:, 1] >= 0) & (out[:, 1] == t)  # two accepted, the second with token t: the third ~ p2[t]
        if int(rows.sum()) >= 400:
            assert_token_law(out[rows, 2].numpy(), p2[t].double().numpy(), V, ("third", t))
            tested[2] += 1
    assert tested[1] >= 3 and tested[2] >= 2, tested
    # the path is the accepted nodes: each a child of the one before, carrying the emitted token
    depth = (path >= 0).sum(1)
    assert ((out >= 0).sum(1) == depth + 1).all()
    for j in range(int(depth.max())):
        live = path[:, j] >= 0
        nodes = path[live, j]
        assert torch.equal(ids[live, nodes], out[live, j])
        above = path[live, j - 1] if j else torch.full_like(nodes, -1)
        assert torch.equal(parents[live, nodes], above)


def test_a_second_sibling_is_accepted_as_often_as_the_residual_says():
    """Without draft probabilities, root children a, b: P(first token = a) = p(a), P(= b) = p(b) (b accepted with
    probability p(b) / (1 - p(a)) after a's rejection), and no other token is recovered more often than p says."""
    g = torch.Generator().manual_seed(3)
    p = random_dist(g, V, sharp=1.0)
    tp = torch.cat([p[None], random_dist(g, 2, V)], 0)[None].expand(N, 3, V).contiguous()
    ids = torch.tensor([[1, 4]]).expand(N, 2).contiguous()
    out, path = tree_rejection_sample(tp, ids, torch.tensor([[-1, -1]]).expand(N, 2).contiguous(),
                                      seeds=torch.arange(N) + 77)
    assert_token_law(out[:, 0].numpy(), p.double().numpy(), V, "first")
    assert torch.equal(path[:, 0] == 0, out[:, 0] == 1) and torch.equal(path[:, 0] == 1, out[:, 0] == 4)
