"""A draft tree in a sequence's pages: where its nodes are written, and how the accepted path is kept.

A round that scores a draft tree (:mod:`spec_decode.tree`) writes node i's keys and values into the slot after the
committed tokens plus i, in node order, each computed at its own depth's position under the tree mask
(:mod:`.paged_forward`). After the round the sequence holds only its committed tokens (``PagedSequence.ids``, all
that the prefix index may register) and remembers the tree (``PagedSequence.tree``). The next round's token ids show
which path was accepted: :func:`keep_accepted_path` moves those nodes' keys and values into the slots that follow the
committed tokens (node at depth d to slot ``start + d - 1``), exactly what a chain of those tokens would have written
there, and the rest of the tree is rolled back with the usual truncation. vLLM's tree attention backend and EAGLE's
reference code keep the accepted path the same way (a gather of the accepted slots into place).
"""

from __future__ import annotations

from ..tree import chain_parents, matched_path
from .kv_pool import KVPool
from .pages import PagedSequence


def row_parents(n_new: int, tree_parents: list[int] | None) -> list[int] | None:
    """A round row's parents over its ``n_new`` new tokens (:class:`~.paged_forward.RoundRow`) when its last
    ``len(tree_parents)`` tokens are a draft tree (parents among the drafts, -1: the token before them); None for a
    chain (``tree_parents`` None).

    Raises:
        ValueError: no new token before the drafts (the last committed token is always new in a scoring round).
    """
    if tree_parents is None:
        return None
    m = len(tree_parents)
    first = n_new - m  # column of the first draft
    if first < 1:
        raise ValueError(f"a draft tree of {m} nodes needs the last committed token among the {n_new} new tokens")
    return chain_parents(first) + [first - 1 if p < 0 else first + p for p in tree_parents]


def keep_accepted_path(seq: PagedSequence, ids: list[int], pool: KVPool, page_size: int) -> None:
    """Move the keys and values of the longest path of ``seq.tree`` whose tokens follow ``seq.ids`` in ``ids`` into
    the slots after ``seq.ids``, and extend ``seq.ids`` by those tokens; forget the tree. Nothing moves when ``ids``
    does not start with ``seq.ids`` (a rollback) or follows no node."""
    if seq.tree is None:
        return
    start, tokens, parents = seq.tree
    seq.tree = None
    if len(seq.ids) != start or len(ids) <= start or ids[:start] != seq.ids:
        return
    path = matched_path(tokens, parents, ids[start:])

    def slot(position: int) -> int:
        return seq.pages[position // page_size] * page_size + position % page_size

    moves = [(slot(start + node), slot(start + depth)) for depth, node in enumerate(path) if node != depth]
    pool.copy_slots([s for s, _ in moves], [d for _, d in moves])
    seq.ids = seq.ids + [tokens[i] for i in path]


__all__ = ["keep_accepted_path", "row_parents"]
