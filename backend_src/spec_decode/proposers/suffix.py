"""Suffix decoding (Oliaro et al., arXiv 2411.04975; Snowflake Arctic Inference ``SuffixDecodingCache``).

A depth-limited suffix trie with occurrence counts: node(s) counts how often the token string s (|s| <= max_tree_depth)
occurred. Each active request has a trie over its prompt and response so far; one global trie holds earlier responses
(FIFO eviction past ``max_cached_requests``). To speculate, for match lengths m = 1.. the node of the context's last m
tokens is found; from it the most frequent child is followed while the running product of child/parent counts stays
at or above ``min_token_prob``, for at most min(k, floor(m * max_spec_factor + max_spec_offset)) tokens. The score
(sum of those probabilities, the expected number of accepted tokens) picks the match length (ties to the longer match)
and the tree (request or global). No draft probabilities: the verifier treats q as one-hot.

Pure Python dictionaries: updates cost O(max_tree_depth) per token and a speculation O(m^2) dictionary steps for the
longest match m. Memory grows with (tokens x depth) for text that never repeats; the global trie is bounded by count.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from dataclasses import dataclass

import torch

from ..sampling import SamplingParams
from .base import Proposal

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
    """A speculation: ``tokens`` with ``probs`` (running products), ``score`` = sum(probs), ``match_len`` m."""

    tokens: list[int]
    probs: list[float]
    score: float
    match_len: int


def speculate(tree: SuffixTree, context: list[int], max_spec_tokens: int, max_spec_factor: float = 1.0,
              max_spec_offset: float = 0.0, min_token_prob: float = 0.1, nodes: list | None = None) -> SuffixDraft:
    """Best speculation from ``tree`` for the end of ``context`` (see module docstring).

    Args:
        nodes: the nodes of context's suffixes by length when already known (a request's own trie, whose current
            sequence is the context: :meth:`SuffixTree.suffix_nodes`), which saves walking from the root for each m.

    Returns:
        :class:`SuffixDraft` (empty tokens and score 0 when nothing matches).
    """
    best = SuffixDraft([], [], 0.0, 0)
    for m in range(1, min(tree.max_depth, len(context)) + 1):
        if nodes is not None:
            node = nodes[m] if m < len(nodes) else None
        else:
            node = tree.find(context[len(context) - m :])
        if node is None or node[_COUNT] <= 0:
            break  # a longer suffix cannot occur if this one does not
        allowed = min(max_spec_tokens, int(m * max_spec_factor + max_spec_offset))
        tokens, probs, prob = [], [], 1.0
        while len(tokens) < allowed and node[_CHILDREN]:
            tok, child = max(node[_CHILDREN].items(), key=lambda kv: (kv[1][_COUNT], -kv[0]))
            prob *= child[_COUNT] / node[_COUNT]
            if prob < min_token_prob:
                break
            tokens.append(tok)
            probs.append(prob)
            node = child
        score = sum(probs)
        if score > best.score or (score == best.score and score > 0):
            best = SuffixDraft(tokens, probs, score, m)
    return best


class SuffixProposer:
    """Suffix-decoding proposer: a trie per active request plus a global trie of earlier responses.

    Args:
        max_tree_depth: longest stored substring (default 64).
        max_cached_requests: responses kept in the global trie (FIFO eviction); 0 disables the global trie.
        max_spec_factor, max_spec_offset: at most floor(m * factor + offset) tokens for a match of length m.
        min_token_prob: stop speculating below this running probability.
        max_active: request tries kept at once (LRU).
    """

    def __init__(self, max_tree_depth: int = 64, max_cached_requests: int = 64, max_spec_factor: float = 1.0,
                 max_spec_offset: float = 0.0, min_token_prob: float = 0.1, max_active: int = 256):
        self.depth = max_tree_depth
        self.max_cached_requests = max_cached_requests
        self.factor, self.offset, self.min_prob = max_spec_factor, max_spec_offset, min_token_prob
        self.global_tree = SuffixTree(max_tree_depth)
        self._responses: deque[list[int]] = deque()
        self._active: OrderedDict[int, tuple[SuffixTree, list[int], int]] = OrderedDict()
        self.max_active = max_active

    def _request_tree(self, seq_id: int, token_ids: list[int]) -> SuffixTree:
        entry = self._active.get(seq_id)
        if entry is not None and token_ids[: len(entry[1])] == entry[1]:
            tree, ids, prompt_len = entry
            tree.extend(token_ids[len(ids) :])
            ids.extend(token_ids[len(ids) :])
            self._active.move_to_end(seq_id)
            return tree
        tree = SuffixTree(self.depth)  # first step (the ids are the prompt) or a cache miss
        tree.extend(token_ids)
        self._active[seq_id] = (tree, list(token_ids), len(token_ids) if entry is None else entry[2])
        while len(self._active) > self.max_active:
            self._active.popitem(last=False)
        return tree

    def speculate(self, seq_id: int, token_ids: list[int], k: int) -> SuffixDraft:
        """Best of the request trie and the global trie for the end of ``token_ids`` (at most ``k`` tokens)."""
        context = list(token_ids[-self.depth :])
        tree = self._request_tree(seq_id, list(token_ids))
        local = speculate(tree, context, k, self.factor, self.offset, self.min_prob, nodes=tree.suffix_nodes())
        glob = speculate(self.global_tree, context, k, self.factor, self.offset, self.min_prob)
        return glob if glob.score > local.score else local

    def propose(self, seq_id: int, token_ids: list[int], k: int, params: SamplingParams, step: int) -> Proposal:
        """Up to ``k`` draft tokens from suffix matching (no draft probabilities)."""
        if k <= 0:
            return Proposal.empty()
        draft = self.speculate(seq_id, token_ids, k)
        return Proposal(torch.tensor(draft.tokens, dtype=torch.int64), None)

    def update(self, seq_id: int, token_ids: list[int]) -> None:
        """Bring the request's trie up to ``token_ids`` (e.g. the final ids, just before :meth:`release`)."""
        if seq_id in self._active:
            self._request_tree(seq_id, list(token_ids))

    def release(self, seq_id: int) -> None:
        """End of a sequence: its response joins the global trie (oldest evicted past the bound)."""
        entry = self._active.pop(seq_id, None)
        if entry is None or self.max_cached_requests <= 0:
            return
        _, ids, prompt_len = entry
        response = ids[prompt_len:]
        if not response:
            return
        self.global_tree.add_sequence(response)
        self._responses.append(response)
        while len(self._responses) > self.max_cached_requests:
            self.global_tree.remove_sequence(self._responses.popleft())

    def active_requests(self) -> int:
        """Request tries currently held."""
        return len(self._active)
