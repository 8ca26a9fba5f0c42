"""spec_decode.verifier with draft trees: greedy rows follow the argmax down any branch, seeded sampled rows give the
tokens of the coupled race whatever the tree, log-probs come from the accepted path's rows, and a round mixing chains
and trees gives each row what it gets alone."""

from __future__ import annotations

import pytest
import torch

from spec_decode import tree
from spec_decode.settings import InvalidInputError
from spec_decode.verifier import Verifier, VerifierRow, VerifierSettings, argmax_walk

V = 11


def _probs(n_rows: int, gen: torch.Generator, sharp: float = 1.0) -> torch.Tensor:
    return torch.softmax(torch.randn(n_rows, V, generator=gen) * sharp, -1)


def _path_log_probs(tp: torch.Tensor, drafts: list[int], parents: list[int] | None, ids: list[int]) -> list[float]:
    rows = tree.rows_of(tree.accepted_nodes(drafts, parents, ids))
    return [float(torch.log(tp[r, t])) for r, t in zip(rows, ids)]


def test_draft_parents_are_checked_at_construction_and_a_chain_is_no_tree():
    tp, drafts = torch.ones(4, V) / V, torch.tensor([1, 2, 3])
    for bad, match in (([-1, 2, 0], r"node 1's parent must lie in \[-1, 1\)"),
                       ([-1, 0], "expected one parent per draft"), ([-1, -1, 0], None)):
        if match is None:  # siblings 1 and 2 differ: a tree
            assert VerifierRow(tp, drafts, None, 0, 0, True, draft_parents=torch.tensor(bad)).tree_parents == bad
            continue
        with pytest.raises(InvalidInputError, match=r"'draft_parents': " + match):
            VerifierRow(tp, drafts, None, 0, 0, True, draft_parents=torch.tensor(bad))
    with pytest.raises(InvalidInputError, match="'draft_parents': node 1 repeats token 1"):
        VerifierRow(tp, torch.tensor([1, 1, 3]), None, 0, 0, True, draft_parents=torch.tensor([-1, -1, 0]))
    with pytest.raises(InvalidInputError, match="'draft_parents': must be \\[k\\] integers"):
        VerifierRow(tp, drafts, None, 0, 0, True, draft_parents=torch.tensor([-1.0, 0.0, 1.0]))
    assert VerifierRow(tp, drafts, None, 0, 0, True, draft_parents=torch.tensor([-1, 0, 1])).tree_parents is None


def _greedy_tree(gen: torch.Generator):
    """A tree whose argmax path runs through the second root-level node and then its second child."""
    tp = _probs(6, gen, 3.0)
    best = tp.argmax(-1).tolist()
    other = [(b + 1) % V for b in best]
    # nodes: 0 = a wrong root, 1 = the argmax root, 2 = a wrong child of 1, 3 = the argmax child of 1, 4 = under 0
    drafts = [other[0], best[0], other[2], best[2], best[1]]
    parents = [-1, -1, 1, 1, 0]
    expected = [best[0], best[2], best[4]]  # node 1's row is 2, node 3's row is 4
    return tp, drafts, parents, expected


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("method", ["rejection", "typical"])
def test_a_greedy_tree_row_follows_the_argmax_into_a_later_branch(method, backend):
    gen = torch.Generator().manual_seed(0)
    ver = Verifier(VerifierSettings(backend=backend))
    for _ in range(5):
        tp, drafts, parents, expected = _greedy_tree(gen)
        ids, lps = ver.verify(tp, torch.tensor(drafts), None, 5, 1, True, method, draft_parents=torch.tensor(parents))
        assert ids == expected
        assert lps == pytest.approx(_path_log_probs(tp, drafts, parents, ids), rel=1e-6)
        best, best_probs = tp.argmax(-1), tp.max(-1).values
        walked = argmax_walk(best.tolist(), best_probs, drafts, parents)
        assert walked[0] == ids and walked[1] == pytest.approx(lps, rel=1e-6)


def test_argmax_walk_with_chain_parents_is_the_chain_walk_and_a_zero_argmax_stops_it():
    gen = torch.Generator().manual_seed(1)
    for case in range(40):
        k = case % 5
        tp = torch.softmax(torch.randint(0, 3, (k + 1, V), generator=gen).float(), -1)
        best, bp = tp.argmax(-1).tolist(), tp.max(-1).values
        drafts = [b if torch.rand((), generator=gen) < 0.7 else (b + 1) % V for b in best[:k]]
        assert argmax_walk(best, bp, drafts, tree.chain_parents(k)) == argmax_walk(best, bp, drafts)
    tp, drafts, parents, expected = _greedy_tree(gen)
    bp = tp.max(-1).values.clone()
    bp[2] = 0.0  # node 1's row masked entirely: node 3 is not accepted, its argmax is emitted
    assert argmax_walk(tp.argmax(-1).tolist(), bp, drafts, parents)[0] == expected[:2]


def _race(tp_row: torch.Tensor, seed: int, position: int, backend: str) -> int:
    """What a seeded row without drafts emits at ``position`` (``none``: k = 0)."""
    ids, _ = Verifier(VerifierSettings(backend=backend)).verify(tp_row[None], torch.zeros(0, dtype=torch.int64), None,
                                                                seed, 9, False, "rejection", position, True)
    return ids[0]


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_a_coupled_tree_row_emits_what_no_drafts_and_a_chain_emit(backend):
    """Seeded sampled rows: the tree is walked with the race keyed by (seed, position + depth), so the tokens are
    those of k = 0 rows at each position, and of a chain through the same rows; drafts off the race's path (here the
    first root-level node) change nothing."""
    gen = torch.Generator().manual_seed(2)
    ver = Verifier(VerifierSettings(backend=backend))
    for seed in range(6):
        position = 10 + seed
        tp = _probs(6, gen)
        t0 = _race(tp[0], seed, position, backend)
        # nodes: 0 = a wrong root, 1 = t0; 2 = t1 under 1 (row 2); 3 = under 0; 4 = t2 under 2 (row 3) when seed even
        t1 = _race(tp[2], seed, position + 1, backend)
        t2 = _race(tp[3], seed, position + 2, backend)
        drafts = [(t0 + 1) % V, t0, t1, 0, t2 if seed % 2 == 0 else (t2 + 1) % V]
        parents = [-1, -1, 1, 0, 2]
        ids, lps = ver.verify(tp, torch.tensor(drafts), None, seed, 3, False, "rejection", position, True,
                              torch.tensor(parents))
        t3 = _race(tp[5], seed, position + 3, backend) if seed % 2 == 0 else None
        expected = [t0, t1, t2] + ([t3] if t3 is not None else [])
        assert ids == expected
        assert lps == pytest.approx(_path_log_probs(tp, drafts, parents, ids), rel=1e-6)
        chain_rows = tp[[0, 2, 3, 5]] if t3 is not None else tp[[0, 2, 3]]
        chain = ver.verify(chain_rows, torch.tensor(expected[:-1]), None, seed, 4, False, "rejection", position, True)
        assert chain[0] == ids and chain[1] == pytest.approx(lps, rel=1e-6)


def _mixed_rows(gen: torch.Generator) -> list[VerifierRow]:
    """Chains and trees of every kind: rejection with and without draft probabilities, typical, greedy, coupled."""
    rows = []
    for i in range(16):
        is_tree = i % 2 == 1
        k = 2 + i % 4 if is_tree else 1 + i % 5
        # a tree's second node is a second root-level node: never a chain
        parents = ([-1, -1] + [int(torch.randint(-1, j, (), generator=gen)) for j in range(2, k)] if is_tree
                   else tree.chain_parents(k))
        tp = _probs(k + 1, gen, 2.0)
        drafts: list[int] = []  # often a likely token of the parent's row; siblings distinct
        for j, p in enumerate(parents):
            taken = {drafts[c] for c in range(j) if parents[c] == p}
            t = int(torch.multinomial(tp[p + 1], 1, generator=gen))
            while t in taken:
                t = (t + 1) % V
            drafts.append(t)
        with_dp, method = i % 3 == 1, "typical" if i % 3 == 2 else "rejection"
        dp = _probs(k, gen) if with_dp else None
        greedy, seeded = i % 7 == 0, i % 4 == 3
        rows.append(VerifierRow(tp, torch.tensor(drafts), dp, 100 + i, i, greedy, method, 20 + i, seeded,
                                torch.tensor(parents) if is_tree else None))
    return rows


@pytest.mark.parametrize("backend", ["torch", "triton"])  # triton: the kernels under TRITON_INTERPRET=1
def test_a_round_mixing_chains_and_trees_gives_each_row_what_it_gets_alone(backend, monkeypatch):
    import spec_decode.verifier.verifier as step
    calls: list[str] = []
    for name in ("rejection_sample", "typical_acceptance_sample", "tree_rejection_sample", "tree_typical_sample",
                 "coupled_sample"):
        real = getattr(step, name)
        monkeypatch.setattr(step, name, lambda *a, _real=real, _name=name, **kw: calls.append(_name) or _real(*a, **kw))
    gen = torch.Generator().manual_seed(3)
    rows = _mixed_rows(gen)
    assert any(r.tree_parents is not None for r in rows) and any(r.tree_parents is None for r in rows)
    ver = Verifier(VerifierSettings(backend=backend))
    assert sum(ver.is_coupled(r) and r.tree_parents is not None for r in rows) == 2
    alone = [ver.verify_batch([r])[0] for r in rows]
    calls.clear()
    got = ver.verify_batch(rows)
    for g, a, row in zip(got, alone, rows):
        assert g[0] == a[0]
        assert g[1] == pytest.approx(a[1], rel=1e-6)
        drafts = row.draft_token_ids.tolist()
        assert g[1] == pytest.approx(_path_log_probs(row.target_probs, drafts, row.tree_parents, g[0]), rel=1e-6)
    # one call per kind of tree row (coupled tree rows race with rejection_sample, one call per depth)
    assert calls.count("tree_rejection_sample") == 2 and calls.count("tree_typical_sample") == 1
    assert sum(len(ids) - 1 for ids, _ in got) > 0  # some drafts were accepted
