"""Medusa's candidate trees: which combinations of the heads' top-k tokens a round verifies.

Medusa's heads all read the same hidden state, so head i's top-k tokens do not depend on what slot i-1 drafted: a
node of the tree is a path of top-k indices (c_0, ..., c_d), its token head d's c_d-th best, its parent the path
without its last index. Medusa's authors verify a fixed tree of such paths tuned offline (``medusa_choices``, e.g. the
63 paths of ``mc_sim_7b_63`` in FasterDecoding/Medusa ``medusa/model/medusa_choices.py``, tuned for Vicuna-7B); a
dynamic tree takes instead, per round, the paths of highest joint probability prod_i p_i(c_i) (EAGLE-2's rule, applied
to Medusa's independent heads). Both keep only nodes whose joint probability passes the confidence threshold, and at
most the request's node budget k.

Paths are tuples of int; a tree is a list of paths in topological order (each path's parent before it), so its
``draft_parents`` are each path's parent's index (-1 for a depth-1 path).
"""

from __future__ import annotations

import heapq
import json
from collections.abc import Sequence

Path = tuple[int, ...]

PUBLISHED_CHOICES: dict[str, list[list[int]]] = {
    # FasterDecoding/Medusa, medusa/model/medusa_choices.py: the tree its authors tuned for Vicuna-7B (63 nodes)
    "mc_sim_7b_63": [
        [0], [0, 0], [1], [0, 1], [2], [0, 0, 0], [1, 0], [0, 2], [3], [0, 3], [4], [0, 4], [2, 0], [0, 5], [0, 0, 1],
        [5], [0, 6], [6], [0, 7], [0, 1, 0], [1, 1], [7], [0, 8], [0, 0, 2], [3, 0], [0, 9], [8], [9], [1, 0, 0],
        [0, 2, 0], [1, 2], [0, 0, 3], [4, 0], [2, 1], [0, 0, 4], [0, 0, 5], [0, 0, 0, 0], [0, 1, 1], [0, 0, 6],
        [0, 3, 0], [5, 0], [1, 3], [0, 0, 7], [0, 0, 8], [0, 0, 9], [6, 0], [0, 4, 0], [1, 4], [7, 0], [0, 1, 2],
        [2, 0, 0], [3, 1], [2, 2], [8, 0], [0, 5, 0], [1, 5], [1, 0, 1], [0, 2, 1], [9, 0], [0, 6, 0], [0, 0, 0, 1],
        [1, 6], [0, 7, 0]],
}
"""Published ``medusa_choices`` trees by name."""

DYNAMIC = "dynamic"
TOP_K = 10
"""Each head's top-k that a tree draws from (the published trees use indices 0-9)."""


def parse_choices(value: str) -> list[Path] | None:
    """The ``medusa_choices`` setting: ``dynamic`` (None: the tree by joint probability), the name of a published tree
    (:data:`PUBLISHED_CHOICES`), or a JSON list of paths of top-k indices (``[[0], [0, 0], [1]]``).

    Raises:
        ValueError: not one of those; an empty list; or paths that are not a tree in topological order (a path whose
            parent is not listed before it, a repeated path, an empty path, an index that is not an integer in
            [0, :data:`TOP_K`)).
    """
    value = value.strip()
    if value == DYNAMIC:
        return None
    if value in PUBLISHED_CHOICES:
        raw: object = PUBLISHED_CHOICES[value]
    else:
        try:
            raw = json.loads(value)
        except json.JSONDecodeError:
            raise ValueError(f"medusa_choices must be {DYNAMIC!r}, one of {sorted(PUBLISHED_CHOICES)} or a JSON list "
                             f"of paths of top-k indices, got {value[:60]!r}") from None
    allowed = (f"{DYNAMIC!r}, one of {sorted(PUBLISHED_CHOICES)} or a non-empty JSON list of non-empty lists of "
               f"top-k indices in [0, {TOP_K}), each after its parent, e.g. [[0], [0, 0], [1]]")
    if not isinstance(raw, list) or not raw or not all(
            isinstance(p, list) and p and all(type(c) is int and 0 <= c < TOP_K for c in p) for p in raw):
        raise ValueError(f"medusa_choices: must be {allowed}")
    paths = [tuple(p) for p in raw]
    seen: set[Path] = set()
    for p in paths:
        if p in seen:
            raise ValueError(f"medusa_choices: the path {_short(p)} is listed twice")
        if len(p) > 1 and p[:-1] not in seen:
            raise ValueError(f"medusa_choices: the path {_short(p)} comes before its parent {_short(p[:-1])}")
        seen.add(p)
    return paths


def _short(path: Path) -> str:
    """A path for a message, cut to its first 8 indices."""
    return str(list(path)) if len(path) <= 8 else f"[{', '.join(map(str, path[:8]))}, ... ({len(path)} indices)]"


def _joint(path: Path, top_probs: Sequence[Sequence[float]]) -> float:
    out = 1.0
    for depth, c in enumerate(path):
        out *= top_probs[depth][c]
    return out


def dynamic_tree(top_probs: Sequence[Sequence[float]], budget: int, min_prob: float) -> list[Path]:
    """The ``budget`` paths of highest joint probability, in decreasing order (so each parent comes before its
    children), among paths whose joint probability is >= ``min_prob``.

    Args:
        top_probs: per head (depth), its top-k probabilities in decreasing order (k may differ per head).
        budget: the most nodes (>= 0).
        min_prob: the confidence threshold (a path below it, and so every path under it, is left out).

    Returns:
        The paths. Enumerated best first: from a popped path, its next sibling (last index + 1) and its first child
        (index 0 at the next depth) are pushed; both are at most as probable, so every path is popped after its
        parent and the pops come in decreasing joint probability (ties: the order of a heap of (−p, path)).
    """
    out: list[Path] = []
    if budget <= 0 or not top_probs or not top_probs[0]:
        return out
    heap: list[tuple[float, Path]] = [(-top_probs[0][0], (0,))]
    while heap and len(out) < budget:
        neg, path = heapq.heappop(heap)
        if -neg < min_prob:
            break  # every path left is at most as probable
        out.append(path)
        depth, last = len(path) - 1, path[-1]
        if last + 1 < len(top_probs[depth]):
            sibling = path[:-1] + (last + 1,)
            heapq.heappush(heap, (-_joint(sibling, top_probs), sibling))
        if depth + 1 < len(top_probs) and top_probs[depth + 1]:
            child = path + (0,)
            heapq.heappush(heap, (-_joint(child, top_probs), child))
    return out


def choices_tree(choices: Sequence[Path], top_probs: Sequence[Sequence[float]], budget: int,
                 min_prob: float) -> list[Path]:
    """The first ``budget`` paths of a fixed tree that this round's heads can draft: within the heads (depth) and
    their top-k (index), with a joint probability >= ``min_prob`` and a parent that was kept, in the tree's order."""
    out: list[Path] = []
    kept: set[Path] = set()
    for p in choices:
        if len(out) >= budget:
            break
        if len(p) > len(top_probs) or any(c >= len(top_probs[d]) for d, c in enumerate(p)):
            continue
        if (len(p) > 1 and p[:-1] not in kept) or _joint(p, top_probs) < min_prob:
            continue
        out.append(p)
        kept.add(p)
    return out


def tree_drafts(paths: Sequence[Path], top_ids: Sequence[Sequence[int]],
                top_probs: Sequence[Sequence[float]]) -> tuple[list[int], list[int], float]:
    """A tree of paths as drafts: (token per node: head d's c_d-th best id; parent per node: the index of the path
    without its last index, -1 at depth 1; score: the sum of the nodes' joint probabilities).

    Raises:
        KeyError: a path whose parent is not among the paths before it.
    """
    index = {p: i for i, p in enumerate(paths)}
    tokens = [top_ids[len(p) - 1][p[-1]] for p in paths]
    parents = [-1 if len(p) == 1 else index[p[:-1]] for p in paths]
    return tokens, parents, sum(_joint(p, top_probs) for p in paths)


__all__ = ["DYNAMIC", "PUBLISHED_CHOICES", "TOP_K", "choices_tree", "dynamic_tree", "parse_choices", "tree_drafts"]
