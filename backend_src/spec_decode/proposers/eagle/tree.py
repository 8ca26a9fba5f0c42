"""EAGLE's dynamic draft trees (EAGLE-2, Li et al. 2024, arXiv 2406.16858; the authors' ``topK_genrate`` in
SafeAILab/EAGLE ``eagle/model/cnets.py``; SGLang's ``--speculative-eagle-topk`` / ``--speculative-num-steps`` /
``--speculative-num-draft-tokens``).

Per round, for every request that takes trees (``tree`` and room for more than one node), from the output of its last
committed pair (which gives the distribution of x_{n+1}):

1. **Expand.** At depth d (0-based) every frontier node's distribution (the request's processors and sampling
   transforms applied, :func:`~spec_decode.proposers.base.draft_distribution`) gives its ``top_k`` (the request's
   ``tree_top_k``, else the proposer's) most probable
   children, each with a joint probability: its parent's times its own. Every child of non-zero probability whose
   joint probability passes the confidence threshold becomes a candidate; the ``top_k`` candidates of highest joint
   probability are the next frontier.
2. **Head forward.** The new frontier's pairs (parent's output, the child's token), at position ``n + d``, run through
   the head in one batched forward over every request's frontier
   (:meth:`~.proposer.EagleProposer.forward_pairs`). Their keys and values are written after the context's committed
   pairs, and each attends to the committed pairs, its ancestors' pairs and itself (a tree mask,
   :func:`ancestor_mask`). This repeats up to ``depth`` levels (capped by the node budget k and the target's
   positions).
3. **Rerank.** The k candidates of highest joint probability are kept
   (:func:`~spec_decode.proposers.speculators.candidate_tree.select_nodes`): a child's joint probability is at most its
   parent's, so a kept node's parent is kept, and the kept nodes form a tree.

The drafted pairs are dropped once drafting ends (the context keeps only committed pairs): the next step brings the
target's hidden states of the accepted path and the head recomputes those pairs from them, as in the chain.

The trees carry no draft probabilities: the nodes are chosen deterministically (the most probable children, no draw),
so the verifier takes each as a one-hot q and its rejection sampling stays exactly the target's law (a one-hot child
c is accepted with the target's p(c), and on rejection c leaves the residual; Jeon et al. 2024's recursive rejection
sampling with deterministic drafts).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from ..base import Proposal, ProposalRequest, draft_distribution, top_k_to_host
from ..speculators.candidate_tree import Candidate, candidate_path, select_nodes

if TYPE_CHECKING:
    from .context import EagleContext
    from .proposer import EagleProposer


@dataclass
class _Growing:
    """One request's tree while it grows: its candidates, the candidates on its frontier (their states are rows of
    the packed state) and the offset of each expanded candidate's pair after the committed ones."""

    request: ProposalRequest
    ctx: EagleContext
    depth: int  # levels it may draft
    width: int  # children per expanded node and frontier nodes per level (top_k)
    committed: int  # the context's committed pairs
    candidates: list[Candidate] = field(default_factory=list)
    frontier: list[int] = field(default_factory=lambda: [-1])  # -1: the last committed token
    pair_of: dict[int, int] = field(default_factory=dict)  # candidate -> its pair's offset after the committed ones


def ancestor_mask(committed: int, pair_of: dict[int, int], candidates: list[Candidate], nodes: list[int]
                  ) -> torch.Tensor:
    """The tree mask of new pairs: [len(nodes), committed + P + len(nodes)] bool (P pairs drafted before them), row m
    True at the committed pairs, at the pairs of node m's ancestors and at its own (column ``committed + P + m``).

    Args:
        committed: pairs before the tree. pair_of: each expanded candidate's pair offset (P of them).
        candidates: the tree's candidates (parents index into it, -1: the last committed token).
        nodes: the candidates whose pairs are new, in their pairs' order.
    """
    drafted = len(pair_of)
    out = torch.zeros(len(nodes), committed + drafted + len(nodes), dtype=torch.bool)
    out[:, :committed] = True
    for m, node in enumerate(nodes):
        out[m, committed + drafted + m] = True
        up = candidates[node].parent
        while up >= 0:
            out[m, committed + pair_of[up]] = True
            up = candidates[up].parent
    return out


def draft_trees(proposer: EagleProposer, requests: list[ProposalRequest], ctxs: list[EagleContext],
                state: torch.Tensor, depths: list[int]) -> list[Proposal]:
    """Dynamic trees (module docstring) for requests whose contexts hold their committed pairs.

    Args:
        proposer: the EAGLE proposer (its head, vocabulary, ``top_k`` where a request sets none, threshold and
            ``forward_pairs``).
        requests: the requests that take trees, each with room for >= 2 nodes.
        ctxs: their contexts (``length`` = committed pairs; the drafted pairs are written after them, ``length``
            grows, and the caller cuts them off).
        state: [R, H] the outputs of their last committed pairs.
        depths: per request, the levels it may draft (>= 1: its room, capped by ``depth``).

    Returns:
        per request, a tree of at most ``request.k`` nodes (target ids, ``draft_parents``, no ``draft_probs``; score:
        the sum of the kept nodes' joint probabilities), or a chain when the tree is one; empty when no child passes
        the threshold.

    Raises:
        ValueError: from a request's grammar.
    """
    model, vocab = proposer.model, proposer.vocab
    trees = [_Growing(r, ctx, d, min(r.tree_shape(proposer.top_k, proposer.depth)[0], len(vocab)), ctx.length)
             for r, ctx, d in zip(requests, ctxs, depths)]
    active = list(range(len(trees)))  # the trees with a frontier whose states are the rows of ``state``
    for d in range(max(depths)):
        logits = model.logits(state)
        owners = [(t, f) for t in active for f in trees[t].frontier]
        probs = torch.stack([draft_distribution(logits[row], trees[t].request, candidate_path(trees[t].candidates, f),
                                                vocab.token_ids, proposer.grammar)
                             for row, (t, f) in enumerate(owners)])
        top_probs, top_ids = top_k_to_host(probs, max(trees[t].width for t in active))  # one copy per level
        children: dict[int, list[tuple[float, int, int]]] = {t: [] for t in active}  # (joint, parent, draft index)
        for row, (t, f) in enumerate(owners):
            base, width = 1.0 if f < 0 else trees[t].candidates[f].joint, trees[t].width
            children[t] += [(base * p, f, i) for p, i in zip(top_probs[row][:width], top_ids[row][:width])
                            if p > 0 and base * p >= proposer.min_token_prob]
        row_of = {owner: row for row, owner in enumerate(owners)}  # (tree, node) -> its output's row of state
        step, parents, tokens = [], [], []
        for t in active:
            tree = trees[t]
            ranked = sorted(children[t], key=lambda c: -c[0])
            first = len(tree.candidates)
            tree.candidates += [Candidate(f, int(vocab.token_ids[i]), joint, d + 1) for joint, f, i in ranked]
            if d + 1 >= tree.depth or not ranked:
                tree.frontier = []
                continue
            tree.frontier = list(range(first, first + min(tree.width, len(ranked))))
            step.append(t)
            for c, (_, f, i) in zip(tree.frontier, ranked):
                parents.append(row_of[(t, f)])
                tokens.append(tree.candidates[c].token if model.embeds_target_ids else i)
        if not step:
            break
        dev = state.device
        z = model.pair_inputs(state[torch.tensor(parents, device=dev)], torch.tensor(tokens, device=dev))
        work, masks, at = [], [], 0
        for t in step:
            tree, n = trees[t], len(trees[t].frontier)
            masks.append(ancestor_mask(tree.committed, tree.pair_of, tree.candidates, tree.frontier))
            position = len(tree.request.token_ids) - 1 + d
            work.append((tree.ctx, z[at : at + n], torch.full((n,), position, dtype=torch.int64, device=dev)))
            at += n
        state = torch.cat(proposer.forward_pairs(work, masks))
        for t in step:
            tree = trees[t]
            for c in tree.frontier:
                tree.pair_of[c] = len(tree.pair_of)
            tree.ctx.length += len(tree.frontier)
        active = step
    out = []
    for tree in trees:
        if not tree.candidates:
            out.append(Proposal.empty())
            continue
        drafts, parents_, score = select_nodes(tree.candidates, tree.request.k)
        out.append(Proposal.of(drafts, score, parents_))
    return out
