"""Suffix decoding's tree, in pure Python: a depth-limited suffix trie with counts, and the speculation over it.

The reference semantics of suffix decoding (Oliaro et al., arXiv 2411.04975; Snowflake Arctic Inference
``SuffixTree``): node(s) counts how often the token string s (|s| <= max_tree_depth) occurred. To speculate, for match
lengths m = 1.. the node of the context's last m tokens is found; from it the most frequent child is followed while the
running product of child/parent counts stays at or above ``min_token_prob``, for at most min(k, floor(m *
max_spec_factor + max_spec_offset)) tokens. The score (sum of those probabilities, the expected number of accepted
tokens) picks the match length (ties to the longer match). The tests check it against brute force; Arctic's C++ tree
(:mod:`.cache`) is the fast engine.

With ``use_tree`` (Arctic's ``use_tree_spec``: ``SuffixTree::_speculate_tree``) the draft is a token tree instead of
a chain: from the matched node, continuations are expanded best-first by their running probability (product of
child/parent counts along the path) while it stays at or above ``min_token_prob``, up to the same token bound, now a
bound on the nodes. Its score is again the sum of the nodes' probabilities (the expected number of accepted tokens: a
node is accepted when its whole path is), and picks the match length the same way. :func:`chain_first` puts the nodes
in the order of :mod:`spec_decode.tree`, the most probable chain first.
"""

from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass, field

from ...tree import chain_parents

_COUNT, _CHILDREN = 0, 1


def _new_node() -> list:
    return [0, {}]


class SuffixTree:
    """Depth-limited suffix trie with counts over one or more token sequences.

    Args:
        max_depth: longest substring stored (>= 1).
    """

    def __init__(self, max_depth: int = 64):
        if max_depth < 1:
            raise ValueError(f"max_depth must be >= 1, got {max_depth}")
        self.max_depth = max_depth
        self.root = _new_node()
        self._active: list[list] = [self.root]  # nodes of the suffixes ending at the last appended token, by length

    def append(self, token: int) -> None:
        """Extend the current sequence by one token: O(max_depth)."""
        new_active = [self.root]
        for node in self._active[: self.max_depth]:
            child = node[_CHILDREN].get(token)
            if child is None:
                child = node[_CHILDREN][token] = _new_node()
            child[_COUNT] += 1
            new_active.append(child)
        self._active = new_active

    def extend(self, tokens) -> None:
        """Append every token of ``tokens`` to the current sequence."""
        for t in tokens:
            self.append(int(t))

    def add_sequence(self, tokens) -> None:
        """Insert a whole new sequence (its suffixes do not join the current one)."""
        self._active = [self.root]
        self.extend(tokens)
        self._active = [self.root]

    def remove_sequence(self, tokens) -> None:
        """Undo :meth:`add_sequence` of the same tokens: decrement counts, drop nodes that reach zero."""
        tokens = [int(t) for t in tokens]
        for end in range(len(tokens)):
            start = max(0, end - self.max_depth + 1)
            # Every substring tokens[i..end] with i >= start was counted once when ``end`` was appended.
            for i in range(start, end + 1):
                path = [self.root]
                for t in tokens[i : end + 1]:
                    path.append(path[-1][_CHILDREN][t])
                path[-1][_COUNT] -= 1
                # Drop nodes that no longer occur, bottom up (a parent may have reached zero earlier, kept alive only
                # by this child).
                for depth in range(len(path) - 1, 0, -1):
                    node = path[depth]
                    if node[_COUNT] > 0 or node[_CHILDREN]:
                        break
                    del path[depth - 1][_CHILDREN][tokens[i + depth - 1]]

    def suffix_nodes(self) -> list[list]:
        """Nodes of the current sequence's suffixes, by length (index m = the last m tokens; index 0 = root)."""
        return self._active

    def find(self, tokens) -> list | None:
        """The node of the string ``tokens`` (None when it never occurred)."""
        node = self.root
        for t in tokens:
            node = node[_CHILDREN].get(int(t))
            if node is None:
                return None
        return node

    def node_count(self) -> int:
        """Number of nodes (memory grows with it)."""
        n, stack = 0, [self.root]
        while stack:
            node = stack.pop()
            n += 1
            stack.extend(node[_CHILDREN].values())
        return n


@dataclass
class SuffixDraft:
    """A speculation (the fields of Arctic's ``SuffixDecodingDraft``).

    Attributes:
        token_ids: drafted token ids (at most max_spec_tokens).
        probs: running probability of each drafted token (product of child/parent counts), non-increasing.
        score: sum(probs), the expected number of accepted tokens.
        match_len: length m of the context suffix the draft continues (0 when nothing matched).
        parents: each token's parent among the drafts (-1: the context's last token), as Arctic's ``parents`` and
            :mod:`spec_decode.tree`; a chain's ``[-1, 0, ..., n - 2]`` unless the speculation was a tree.
    """

    token_ids: list[int] = field(default_factory=list)
    probs: list[float] = field(default_factory=list)
    score: float = 0.0
    match_len: int = 0
    parents: list[int] = field(default_factory=list)


def chain_first(draft: SuffixDraft) -> SuffixDraft:
    """``draft`` with its nodes in depth-first order, the more probable child first (ties: the earlier node), so that
    nodes 0, 1, ... are the most probable chain and every parent precedes its children; a chain is unchanged.

    Arctic's tree speculation returns the nodes in the order its priority queue produced them (topological, but the
    best chain interleaved with other branches).
    """
    n = len(draft.token_ids)
    kids: list[list[int]] = [[] for _ in range(n + 1)]  # kids[p + 1]: the children of node p, in node order
    for i, p in enumerate(draft.parents):
        kids[int(p) + 1].append(i)
    order: list[int] = []
    stack = sorted(kids[0], key=lambda i: (draft.probs[i], -i))  # popped last = most probable
    while stack:
        i = stack.pop()
        order.append(i)
        stack.extend(sorted(kids[i + 1], key=lambda c: (draft.probs[c], -c)))
    new = {old: j for j, old in enumerate(order)}
    return SuffixDraft([draft.token_ids[i] for i in order], [draft.probs[i] for i in order], draft.score,
                       draft.match_len, [new[p] if p >= 0 else -1 for p in (int(draft.parents[i]) for i in order)])


def _chain(node: list, allowed: int, min_token_prob: float) -> tuple[list[int], list[float]]:
    """The greedy walk from ``node``: the most frequent child (ties: the smaller id) while the running probability
    stays >= ``min_token_prob``, at most ``allowed`` tokens."""
    tokens: list[int] = []
    probs: list[float] = []
    prob = 1.0
    while len(tokens) < allowed and node[_CHILDREN]:
        tok, child = max(node[_CHILDREN].items(), key=lambda kv: (kv[1][_COUNT], -kv[0]))
        prob *= child[_COUNT] / node[_COUNT]
        if prob < min_token_prob:
            break
        tokens.append(tok)
        probs.append(prob)
        node = child
    return tokens, probs


def _tree(node: list, allowed: int, min_token_prob: float) -> tuple[list[int], list[float], list[int]]:
    """Best-first expansion from ``node`` (Arctic's ``_speculate_tree``): the open continuation of highest running
    probability becomes the next node while that probability is >= ``min_token_prob``, at most ``allowed`` nodes
    (ties: the continuation opened first; siblings are opened most frequent first, then by smaller id)."""
    tokens: list[int] = []
    probs: list[float] = []
    parents: list[int] = []
    opened = itertools.count()
    heap: list[tuple[float, int, int, list, int]] = []  # (-prob, opening order, token, trie node, parent index)

    def open_children(at: list, prob: float, parent: int) -> None:
        if at[_COUNT] <= 0:
            return
        for tok, child in sorted(at[_CHILDREN].items(), key=lambda kv: (-kv[1][_COUNT], kv[0])):
            p = prob * child[_COUNT] / at[_COUNT]
            if p < min_token_prob or child[_COUNT] <= 0:
                break  # the rest are no more frequent
            heapq.heappush(heap, (-p, next(opened), tok, child, parent))

    open_children(node, 1.0, -1)
    while heap and len(tokens) < allowed:
        neg, _, tok, child, parent = heapq.heappop(heap)
        tokens.append(tok)
        probs.append(-neg)
        parents.append(parent)
        open_children(child, -neg, len(tokens) - 1)
    return tokens, probs, parents


def speculate(tree: SuffixTree, context: list[int], max_spec_tokens: int, max_spec_factor: float = 1.0,
              max_spec_offset: float = 0.0, min_token_prob: float = 0.1, nodes: list | None = None,
              use_tree: bool = False) -> SuffixDraft:
    """Best speculation from ``tree`` for the end of ``context`` (the rule: module docstring).

    Args:
        tree: the trie matched.
        context: token ids; its last m tokens are matched, m = 1 .. min(max_depth, len(context)).
        max_spec_tokens, max_spec_factor, max_spec_offset: a match of m tokens drafts at most
            min(max_spec_tokens, floor(m * max_spec_factor + max_spec_offset)) tokens (nodes of a tree).
        min_token_prob: a draft stops before the token whose running probability falls below this.
        nodes: the nodes of context's suffixes by length when already known (a request's own trie, whose current
            sequence is the context: :meth:`SuffixTree.suffix_nodes`), which saves walking from the root for each m.
        use_tree: draft a token tree, expanded best-first (Arctic's ``use_tree_spec``), in :func:`chain_first`
            order; else the greedy chain.

    Returns:
        :class:`SuffixDraft` (no tokens and score 0 when nothing matches).
    """
    best = SuffixDraft()
    for m in range(1, min(tree.max_depth, len(context)) + 1):
        if nodes is not None:
            node = nodes[m] if m < len(nodes) else None
        else:
            node = tree.find(context[len(context) - m :])
        if node is None or node[_COUNT] <= 0:
            break  # a longer suffix cannot occur if this one does not
        allowed = min(max_spec_tokens, int(m * max_spec_factor + max_spec_offset))
        if use_tree:
            tokens, probs, parents = _tree(node, allowed, min_token_prob)
        else:
            tokens, probs = _chain(node, allowed, min_token_prob)
            parents = chain_parents(len(tokens))
        score = sum(probs)
        if score > best.score or (score == best.score and score > 0):
            best = SuffixDraft(tokens, probs, score, m, parents)
    return chain_first(best) if use_tree else best
