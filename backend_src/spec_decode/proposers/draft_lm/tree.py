"""The draft LM's branching trees: a chain that branches where the draft is unsure.

Per round, for every request that takes trees (``tree`` and room for two nodes or more), level by level from the last
committed token: each frontier node's distribution (the request's processors and sampling transforms applied,
:func:`~spec_decode.proposers.base.draft_distribution`) gives one child, its most probable token, when that token's
probability is at least ``branch_prob``, and else its ``top_k`` most probable tokens (a branch at an unsure position:
the next-best tokens there are known for free). Every child whose joint probability (the product along its path)
passes the confidence threshold is a candidate; the ``top_k`` candidates of highest joint probability are the next
frontier. Each level is one batched forward of the draft LM over every request's tree so far
(:meth:`~spec_decode.engine.kv_cache.CachedCausalLM.logits_batch` with parents: the nodes under the tree mask, on the
draft's paged KV pool); then the ``k`` candidates of highest joint probability are kept
(:func:`~spec_decode.proposers.speculators.candidate_tree.select_nodes`, EAGLE-2's rerank). A tree that never branched
is the greedy chain. ``top_k`` is the request's ``tree_top_k``, else the config's ``draft_tree_top_k``; a request's
``tree_depth`` caps the levels (else up to k).

Each level's forward recomputes the tree's earlier nodes with its new ones (the cache keeps only committed tokens and
the last forward's tree, whose accepted path the next round keeps: :mod:`spec_decode.engine.tree_slots`): at most k + 1
positions per forward (the forwards hold at most k nodes), about one decode step's cost for a small draft.

Like the heads' trees, the nodes are chosen, not drawn: no ``draft_probs``, and the verifier takes each as a one-hot q,
which keeps sampled output exactly the target's.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ..base import Proposal, ProposalRequest, draft_distribution, top_k_to_host
from ..speculators.candidate_tree import Candidate, candidate_path, select_nodes

if TYPE_CHECKING:
    from .proposer import DraftModelProposer


def branch_children(top_probs: list[float], top_ids: list[int], base: float, branch_prob: float,
                    min_token_prob: float) -> list[tuple[float, int]]:
    """A node's children (joint probability, index) from its distribution's top-k (``top_probs`` decreasing, their
    ``top_ids``) and its own joint probability ``base``: the most probable alone when its probability is >=
    ``branch_prob``, else all k; only those of non-zero probability whose joint probability is >= ``min_token_prob``."""
    count = 1 if top_probs and top_probs[0] >= branch_prob else len(top_probs)
    return [(base * p, i) for p, i in zip(top_probs[:count], top_ids[:count]) if p > 0 and base * p >= min_token_prob]


def draft_lm_trees(proposer: DraftModelProposer, requests: list[ProposalRequest], ks: list[int]) -> list[Proposal]:
    """Branching trees (module docstring) for requests that take trees.

    Args:
        proposer: the draft LM proposer (its ``lm``, ``vocab``, ``branch_prob``, threshold, and ``tree_top_k`` where
            a request sets none).
        requests: the requests, each with room ``ks[j] >= 2``: a tree of at most ``ks[j]`` nodes, and as many levels
            or its ``tree_depth`` (:meth:`~spec_decode.proposers.base.ProposalRequest.tree_shape`).

    Returns:
        per request, a tree (target ids, ``draft_parents``, no ``draft_probs``; score the sum of the kept nodes' joint
        probabilities), a chain when it never branched, or empty when no child passed the threshold.

    Raises:
        ValueError: a token id outside the draft's vocabulary, or from a request's grammar.
        KVCacheFull: the round's trees need more pages than the draft's pool has.
    """
    vocab, lm = proposer.vocab, proposer.lm
    shapes = [r.tree_shape(proposer.tree_top_k, 0) for r in requests]
    widths = [w for w, _ in shapes]
    levels = [min(k, depth) for k, (_, depth) in zip(ks, shapes)]
    ids = [proposer.draft_ids(r.token_ids) for r in requests]
    cands: list[list[Candidate]] = [[] for _ in requests]
    draft_id: list[list[int]] = [[] for _ in requests]  # per candidate, its draft-vocabulary id
    in_tree: list[list[int]] = [[] for _ in requests]  # the candidates a forward computes, parents first
    frontier: list[list[int]] = [[-1] for _ in requests]
    active = list(range(len(requests)))
    for d in range(max(levels)):
        calls: list[tuple] = []
        for j in active:
            nodes = in_tree[j]
            if not nodes:
                calls.append((requests[j].seq_id, ids[j], 1))
                continue
            at = {c: n for n, c in enumerate(nodes)}
            parents = [-1 if cands[j][c].parent < 0 else at[cands[j][c].parent] for c in nodes]
            calls.append((requests[j].seq_id, ids[j] + [draft_id[j][c] for c in nodes], len(nodes) + 1, parents))
        logits = lm.logits_batch(calls)
        owners, rows = [], []
        for j, lg in zip(active, logits):
            at = {c: n + 1 for n, c in enumerate(in_tree[j])}  # row of a node's successor; row 0: the committed
            for f in frontier[j]:
                row = lg[0 if f < 0 else at[f]]
                if vocab is not None:
                    row = row[: vocab.unk_index]  # never propose the "outside the set" row
                owners.append((j, f))
                rows.append(draft_distribution(row, requests[j], candidate_path(cands[j], f),
                                               None if vocab is None else vocab.token_ids, proposer.grammar))
        width = min(max(widths[j] for j in active), rows[0].shape[-1])
        top_probs, top_ids = top_k_to_host(torch.stack(rows), width)  # one copy per level
        children: dict[int, list[tuple[float, int, int]]] = {j: [] for j in active}
        for (j, f), tp, ti in zip(owners, top_probs, top_ids):
            base = 1.0 if f < 0 else cands[j][f].joint
            children[j] += [(joint, f, i) for joint, i in branch_children(tp[:widths[j]], ti[:widths[j]], base,
                                                                          proposer.branch_prob,
                                                                          proposer.min_token_prob)]
        still = []
        for j in active:
            ranked = sorted(children[j], key=lambda c: -c[0])
            first = len(cands[j])
            for joint, f, i in ranked:
                draft_id[j].append(i)
                cands[j].append(Candidate(f, i if vocab is None else int(vocab.token_ids[i]), joint, d + 1))
            # at most k nodes in a forward: its positions stay within the room ks[j] gives
            frontier[j] = list(range(first, first + min(widths[j], len(ranked), ks[j] - len(in_tree[j]))))
            if frontier[j] and d + 1 < levels[j]:
                in_tree[j] += frontier[j]
                still.append(j)
        active = still
        if not active:
            break
    out = []
    for j, r in enumerate(requests):
        if not cands[j]:
            out.append(Proposal.empty())
            continue
        drafts, parents, score = select_nodes(cands[j], min(r.k, ks[j]))
        out.append(Proposal.of(drafts, score, parents))
    return out
