"""Candidate trees from the chain heads (IBM's MLP speculator, Arctic's LSTM speculator): their heads' top-k at each
position, expanded EAGLE-2's way.

A chain head's position i reads the state its position i-1 left and the token drafted there, so each node of a tree
has its own state. Per round and per request that takes trees: from the last committed token, position i expands
every node of the frontier (one batched head step over the frontier) into its ``tree_top_k`` most probable children,
and the ``tree_top_k`` children of highest joint probability (the product of their path's probabilities) become the
next frontier; after the heads' ``n_predict`` positions (or fewer, where the budget or the confidence threshold ends
it), the ``k`` expanded nodes of highest joint probability are kept (EAGLE-2, Li et al. 2024: expand the top-k of the
best nodes for ``depth`` steps, then rerank by joint probability; fms-extras' ``n_candidates`` sequences from the
heads' top-k merged by shared prefixes are a tree of the same kind). Every node passes the confidence threshold on its
joint probability. The drafts are deterministic (no ``draft_probs``): the tree verifier takes them as q one-hot,
which keeps sampled output exactly the target's.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ...sampling import NoisePurpose
from ..base import Proposal, ProposalRequest, by_shape, draft_distribution, top_k_to_host
from .base import HeadProposer


@dataclass(frozen=True)
class Candidate:
    """An expanded node: its parent (an index into the candidates, -1: the last committed token), its token, its
    joint probability and its depth (1 = a child of the last committed token)."""

    parent: int
    token: int
    joint: float
    depth: int


def select_nodes(candidates: list[Candidate], budget: int) -> tuple[list[int], list[int], float]:
    """The ``budget`` candidates of highest joint probability as a tree (EAGLE-2's rerank): (tokens, parents in
    :mod:`spec_decode.tree`'s topological order, the sum of their joint probabilities).

    A child's joint probability is at most its parent's, and ties go to the shallower node, so every kept node's
    parent is kept. Kept nodes are ordered by depth (then by rank), their parents renumbered.
    """
    rank = sorted(range(len(candidates)), key=lambda i: (-candidates[i].joint, candidates[i].depth, i))[:budget]
    kept = sorted(rank, key=lambda i: (candidates[i].depth, rank.index(i)))
    index = {c: n for n, c in enumerate(kept)}
    tokens = [candidates[c].token for c in kept]
    parents = [-1 if candidates[c].parent < 0 else index[candidates[c].parent] for c in kept]
    return tokens, parents, sum(candidates[c].joint for c in kept)


def propose_tree(proposer: HeadProposer, request: ProposalRequest) -> Proposal:
    """A candidate tree of at most ``request.k`` nodes for one request with hidden states (module docstring).

    Returns:
        The proposal: drafts [k'] int64, ``draft_parents`` (None when the tree is a chain), no ``draft_probs``;
        empty without hidden states.

    Raises:
        ValueError: from the request's grammar (:func:`~spec_decode.proposers.base.draft_distribution`).
    """
    head = proposer.head
    _, states = proposer.last_states([request], proposer.hidden_size)
    if states is None:
        return Proposal.empty()
    carry = head.begin(states)
    dev, vocab = carry[0].device, head.vocab_size
    candidates: list[Candidate] = []
    frontier = [-1]  # candidate indices (-1: the last committed token)
    tokens = [min(max(request.token_ids[-1], 0), vocab - 1)]  # Arctic Inference clamps too
    top_k, depth = request.tree_shape(proposer.tree_top_k, proposer.tree_depth)
    width = min(top_k, request.k, vocab)
    for i in range(min(head.n_predict, depth)):
        logits, carry = head.step(i, carry, torch.tensor(tokens, dtype=torch.int64, device=dev))
        probs = torch.stack([draft_distribution(logits[row], request, candidate_path(candidates, f), None,
                                                proposer.grammar) for row, f in enumerate(frontier)])
        top_probs, top_ids = top_k_to_host(probs, width)  # one copy per position
        children = []
        for row, f in enumerate(frontier):
            base = 1.0 if f < 0 else candidates[f].joint
            children += [(base * p, row, f, t) for p, t in zip(top_probs[row], top_ids[row])]
        children = [c for c in sorted(children, key=lambda c: -c[0])
                    if c[0] > 0 and c[0] >= proposer.min_token_prob][:width]
        if not children:
            break
        rows, frontier, tokens = [], [], []
        for joint, row, f, t in children:
            candidates.append(Candidate(f, t, joint, i + 1))
            rows.append(row)
            frontier.append(len(candidates) - 1)
            tokens.append(t)
        index = torch.tensor(rows, device=dev)
        carry = tuple(c.index_select(0, index) for c in carry)
    if not candidates:
        return Proposal.empty()
    drafts, parents, score = select_nodes(candidates, request.k)
    return Proposal.of(drafts, score, parents)


def candidate_path(candidates: list[Candidate], node: int) -> list[int]:
    """The tokens from the last committed token's child down to candidate ``node`` (-1: none), the processors'
    prefix of drafts."""
    out = []
    while node >= 0:
        out.append(candidates[node].token)
        node = candidates[node].parent
    return out[::-1]


def propose_heads(proposer: HeadProposer, requests: list[ProposalRequest], purpose: NoisePurpose, chain) -> list[
        Proposal]:
    """Drafts of a chain head for a round: the requests that take trees (``tree``, k >= 2) a candidate tree each
    (:func:`propose_tree`), the others ``chain(proposer, requests, purpose)`` together (the batched chain drafting)."""
    trees = [j for j, r in enumerate(requests) if proposer.takes_tree(r) and r.k > 1]
    return by_shape(len(requests), trees, lambda rows: chain(proposer, [requests[j] for j in rows], purpose),
                    lambda rows: [propose_tree(proposer, requests[j]) for j in rows])


__all__ = ["Candidate", "candidate_path", "propose_heads", "propose_tree", "select_nodes"]
