"""Draft trees: many candidate continuations of one sequence, scored in one target forward and verified together.

A step's drafts are n nodes in topological order: ``draft_token_ids`` [n] and ``draft_parents`` [n], where
``parents[i]`` is the index of node i's parent among the drafts, or :data:`ROOT` (-1) for a child of the last
committed token. A parent always comes before its children (``-1 <= parents[i] < i``), and siblings carry distinct
tokens, so a run of tokens names at most one path. A chain, what every proposer drafted before trees, is
``parents[i] = i - 1`` (:func:`chain_parents`); everything that takes parents also takes None for a chain.

The target scores n + 1 rows: row 0 follows the last committed token and row ``i + 1`` follows node i (the context,
then node i's path: :func:`path_of`), at position ``len(token_ids) + depth(i)`` (:func:`depths`; a root-level node
has depth 1, as the first draft of a chain). The verifier walks down from row 0 and emits the accepted path's tokens
and one more (the recovered or bonus token); :func:`accepted_nodes` finds, from the emitted ids alone, which nodes
those were, so the transports pick the hidden-state and log-prob rows of the path (``rows_of``).

This follows SpecInfer's token trees (Miao et al. 2024, "SpecInfer: Accelerating Large Language Model Serving with
Tree-based Speculative Inference and Verification") and the ``parents`` lists that Arctic Inference's suffix cache
returns (``SuffixDecodingCache.speculate(..., use_tree_spec=True)``); vLLM's ``SpecDecodeMetadata`` carries a chain's
flat draft ids and per-row counts in the same spirit.
"""

from __future__ import annotations

from collections.abc import Sequence

from .settings import InvalidInputError

ROOT = -1  # the parent of a root-level node: the last committed token
MAX_TREE_TOP_K = 10  # children per expanded node at most (``tree_top_k``: EAGLE-2's configs use 10)
MAX_TREE_DEPTH = 64  # a dynamic tree's levels at most (``tree_depth``)


def chain_parents(n: int) -> list[int]:
    """The parents of a chain of n drafts: ``[-1, 0, 1, ..., n - 2]``."""
    return list(range(-1, n - 1))


def is_chain(parents: Sequence[int] | None) -> bool:
    """Whether ``parents`` (None: a chain) describe a chain: every node's parent is the node before it."""
    return parents is None or all(int(p) == i - 1 for i, p in enumerate(parents))


def check_tree(tokens: Sequence[int], parents: Sequence[int] | None, name: str = "draft_parents") -> list[int]:
    """The parents of ``tokens`` as Python ints, checked: one per token, ``-1 <= parents[i] < i``, siblings distinct.

    Args:
        tokens: the n draft ids. parents: their parents, or None (a chain).
        name: the input named in the error.

    Returns:
        [n] parents (a chain's when ``parents`` is None).

    Raises:
        InvalidInputError: (naming ``name``) a count that differs from the tokens', a parent outside [-1, i), or two
            siblings with the same token.
    """
    n = len(tokens)
    if parents is None:
        return chain_parents(n)
    out = [int(p) for p in parents]
    if len(out) != n:
        raise InvalidInputError(name, f"expected one parent per draft ({n}), got {len(out)}")
    seen: set[tuple[int, int]] = set()
    for i, (p, t) in enumerate(zip(out, tokens)):
        if not ROOT <= p < i:
            raise InvalidInputError(name, f"node {i}'s parent must lie in [-1, {i}) (parents come first), got {p}")
        if (p, int(t)) in seen:
            raise InvalidInputError(name, f"node {i} repeats token {int(t)} under parent {p} (siblings must differ)")
        seen.add((p, int(t)))
    return out


def depths(parents: Sequence[int]) -> list[int]:
    """Each node's depth: 1 for a child of the last committed token, its parent's + 1 below (a chain: 1..n)."""
    out: list[int] = []
    for p in parents:
        out.append(1 if p < 0 else out[p] + 1)
    return out


def path_of(parents: Sequence[int], node: int) -> list[int]:
    """The nodes from the root-level ancestor of ``node`` down to ``node`` itself (empty for :data:`ROOT`)."""
    path = []
    while node >= 0:
        path.append(node)
        node = int(parents[node])
    return path[::-1]


def path_tokens(tokens: Sequence[int], parents: Sequence[int] | None) -> list[list[int]]:
    """Per target row j (0..n), the draft tokens between the last committed token and the row's position: row 0
    none, row ``i + 1`` node i's path (a chain: ``tokens[:j]``)."""
    if parents is None:
        return [list(tokens[:j]) for j in range(len(tokens) + 1)]
    out: list[list[int]] = [[]]
    for i, p in enumerate(parents):
        out.append(out[int(p) + 1] + [int(tokens[i])])
    return out


def children(parents: Sequence[int]) -> list[list[int]]:
    """Per target row j (0..n), the nodes whose parent is row j's node (row 0: the root-level nodes), in order."""
    out: list[list[int]] = [[] for _ in range(len(parents) + 1)]
    for i, p in enumerate(parents):
        out[int(p) + 1].append(i)
    return out


def matched_path(tokens: Sequence[int], parents: Sequence[int] | None, ids: Sequence[int]) -> list[int]:
    """The nodes of the longest path from the root whose tokens are a prefix of ``ids`` (siblings differ, so it is
    unique)."""
    kids = children(chain_parents(len(tokens)) if parents is None else parents)
    path: list[int] = []
    for tok in ids:
        nxt = next((i for i in kids[path[-1] + 1 if path else 0] if int(tokens[i]) == int(tok)), None)
        if nxt is None:
            break
        path.append(nxt)
    return path


def accepted_nodes(tokens: Sequence[int], parents: Sequence[int] | None, output_ids: Sequence[int]) -> list[int]:
    """The nodes a step accepted, from its emitted ids: the path whose tokens are ``output_ids[:-1]`` (the last id is
    the recovered or bonus token; :func:`matched_path`).

    Raises:
        ValueError: ``output_ids[:-1]`` is not a path of the tree (the verifier's output does not fit its drafts).
    """
    accepted = list(output_ids[:-1])
    path = matched_path(tokens, parents, accepted)
    if len(path) != len(accepted):
        raise ValueError(f"emitted ids {list(output_ids)} are not a path of the draft tree {list(tokens)}")
    return path


def rows_of(path: Sequence[int]) -> list[int]:
    """The target rows that predicted a step's emitted ids, for its accepted ``path``: row 0, then each accepted
    node's row (``node + 1``); a chain's first ``len(path) + 1`` rows."""
    return [0] + [int(i) + 1 for i in path]


def merge_paths(paths: Sequence[Sequence[int]], max_nodes: int) -> tuple[list[int], list[int]]:
    """A tree of candidate continuations, shared prefixes merged, in the order given (the first path first, so a
    proposer lists its best candidate first), at most ``max_nodes`` nodes (later nodes dropped).

    Returns:
        (tokens [n], parents [n]) in topological order; the first path is the chain of nodes 0, 1, ...
    """
    tokens: list[int] = []
    parents: list[int] = []
    index: dict[tuple[int, int], int] = {}
    for path in paths:
        at = ROOT
        for tok in path:
            key = (at, int(tok))
            if key not in index:
                if len(tokens) >= max_nodes:
                    break
                index[key] = len(tokens)
                tokens.append(int(tok))
                parents.append(at)
            at = index[key]
    return tokens, parents


__all__ = ["MAX_TREE_DEPTH", "MAX_TREE_TOP_K", "ROOT", "accepted_nodes", "chain_parents", "check_tree", "children",
           "depths", "is_chain", "matched_path", "merge_paths", "path_of", "path_tokens", "rows_of"]
