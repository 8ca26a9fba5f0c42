"""Suffix decoding (Oliaro et al., arXiv 2411.04975; Snowflake Arctic Inference ``SuffixDecodingCache``).

A depth-limited suffix tree with occurrence counts: node(s) counts how often the token string s (|s| <= max_tree_depth)
occurred. Each active request has a tree over its prompt and response so far; one global tree holds earlier responses
(FIFO eviction past ``max_cached_requests``). To speculate, for match lengths m = 1.. the node of the context's last m
tokens is found; from it the most frequent child is followed while the running product of child/parent counts stays
at or above ``min_token_prob``, for at most min(k, floor(m * max_spec_factor + max_spec_offset)) tokens. The score
(sum of those probabilities, the expected number of accepted tokens) picks the match length (ties to the longer match)
and the tree (request or global). No draft probabilities: the verifier treats q as one-hot.

:class:`SuffixCache` (the API of Arctic's ``SuffixDecodingCache``: ``start_request``, ``add_active_response``,
``stop_request``, ``speculate``) runs on one of two engines' trees:

- ``arctic`` (default when importable): Arctic Inference's C++ ``SuffixTree``, path-compressed with children kept in
  count order (``scripts/build_suffix_tree.sh`` builds it from the PyPI sdist). Measured at depth 64 with 10,000
  cached responses of 500 tokens: ~330 B per cached token (1.56 GB), ~0.09 ms median per speculate (p99 0.2 ms),
  5-8 us per inserted token (``bench/suffix_cache.py``). It matches at most len(context) - 1 tokens and may break
  ties between equally frequent children differently.
- ``python``: :class:`SuffixTree`, a pure-Python dictionary trie with the same semantics (the reference the tests
  check against brute force; no compiler needed). Updates cost O(max_tree_depth) per token, memory ~300 B per node and
  up to max_tree_depth nodes per token of text that never repeats (~16 KB per cached token at depth 64), so it suits
  small caches only.
"""

from __future__ import annotations

from array import array
from collections import OrderedDict
from dataclasses import dataclass, field

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
    """A speculation (the fields of Arctic's ``SuffixDecodingDraft``).

    Attributes:
        token_ids: drafted token ids (at most max_spec_tokens).
        probs: running probability of each drafted token (product of child/parent counts), non-increasing.
        score: sum(probs), the expected number of accepted tokens.
        match_len: length m of the context suffix the draft continues (0 when nothing matched).
    """

    token_ids: list[int] = field(default_factory=list)
    probs: list[float] = field(default_factory=list)
    score: float = 0.0
    match_len: int = 0


def speculate(tree: SuffixTree, context: list[int], max_spec_tokens: int, max_spec_factor: float = 1.0,
              max_spec_offset: float = 0.0, min_token_prob: float = 0.1, nodes: list | None = None) -> SuffixDraft:
    """Best speculation from ``tree`` for the end of ``context`` (see module docstring).

    Args:
        nodes: the nodes of context's suffixes by length when already known (a request's own trie, whose current
            sequence is the context: :meth:`SuffixTree.suffix_nodes`), which saves walking from the root for each m.

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


class _PythonEngine:
    """Trees of the pure-Python engine: one :class:`SuffixTree` per request, sequences inserted whole in the global."""

    name = "python"

    def __init__(self, depth: int):
        self.depth = depth

    def new_tree(self) -> SuffixTree:
        return SuffixTree(self.depth)

    def extend(self, tree: SuffixTree, tokens: list[int]) -> None:
        tree.extend(tokens)

    def add(self, tree: SuffixTree, seq_id: int, tokens: list[int]) -> None:
        tree.add_sequence(tokens)

    def remove(self, tree: SuffixTree, seq_id: int, tokens) -> None:
        tree.remove_sequence(list(tokens))

    def speculate(self, tree: SuffixTree, context: list[int], own: bool, k: int, factor: float, offset: float,
                  min_prob: float) -> SuffixDraft:
        nodes = tree.suffix_nodes() if own else None  # a request tree's current sequence is the context
        return speculate(tree, context, k, factor, offset, min_prob, nodes=nodes)


class _ArcticEngine:
    """Trees of Arctic Inference's C++ ``SuffixTree`` (path-compressed, children kept in count order)."""

    name = "arctic"

    def __init__(self, depth: int):
        from arctic_inference.suffix_decoding._C import SuffixTree as NativeTree

        self._cls, self.depth = NativeTree, depth

    def new_tree(self):
        return self._cls(self.depth)

    def extend(self, tree, tokens: list[int]) -> None:
        tree.extend(0, tokens)

    def add(self, tree, seq_id: int, tokens: list[int]) -> None:
        tree.extend(seq_id, tokens)

    def remove(self, tree, seq_id: int, tokens: list[int]) -> None:
        tree.remove(seq_id)

    def speculate(self, tree, context: list[int], own: bool, k: int, factor: float, offset: float,
                  min_prob: float) -> SuffixDraft:
        d = tree.speculate(context, k, factor, offset, min_prob, False)
        return SuffixDraft(list(d.token_ids), list(d.probs), float(d.score), int(d.match_len))


class SuffixCache:
    """Suffix decoding's trees (the API of Arctic Inference's ``SuffixDecodingCache``) on either engine.

    Each active request has a tree over its prompt and response so far; a response joins the global tree when its
    request stops, and the oldest responses leave it past ``max_cached_requests`` (FIFO). Unlike Arctic's own cache,
    which inserts a response into the global tree while it is generated, the global tree never holds the request's
    current occurrence of its context, so an exact repeat of an earlier response is drafted with probability 1 per
    token (score = k) instead of 1/2, which hybrid's "score >= k" rule needs.

    Args:
        engine: "python" (:class:`SuffixTree`) or "arctic" (Arctic's C++ tree).
        max_tree_depth: longest stored substring (>= 1).
        max_cached_requests: responses kept in the global tree; 0 disables it.

    Raises:
        ValueError: (methods) starting an active request again, or using a request that is not active.
    """

    def __init__(self, engine: str, max_tree_depth: int = 64, max_cached_requests: int = 10000):
        self.engine = _ArcticEngine(max_tree_depth) if engine == "arctic" else _PythonEngine(max_tree_depth)
        self.max_tree_depth = max_tree_depth
        self.max_cached_requests = max_cached_requests
        self.global_tree = self.engine.new_tree()
        self._local: dict = {}  # req_id -> (tree over prompt + response, response tokens)
        self._cached: OrderedDict = OrderedDict()  # global seq id -> response tokens, oldest first
        self._next_global_id = 0
        self._cached_token_count = 0

    @property
    def active_requests(self):
        """Ids of requests between start_request and stop_request."""
        return self._local.keys()

    @property
    def cached_requests(self) -> int:
        """Number of responses in the global tree."""
        return len(self._cached)

    def cached_tokens(self) -> int:
        """Tokens in the global tree (its memory grows with them)."""
        return self._cached_token_count

    def start_request(self, req_id, prompt_token_ids) -> None:
        """Begin a request: its tree holds the prompt."""
        if req_id in self._local:
            raise ValueError(f"Request '{req_id}' is already active")
        tree = self.engine.new_tree()
        self.engine.extend(tree, [int(t) for t in prompt_token_ids])
        self._local[req_id] = (tree, [])

    def add_active_response(self, req_id, token_ids) -> None:
        """Append generated tokens to the request's tree."""
        if req_id not in self._local:
            raise ValueError(f"Request '{req_id}' is not active")
        tree, response = self._local[req_id]
        tokens = [int(t) for t in token_ids]
        self.engine.extend(tree, tokens)
        response.extend(tokens)

    def stop_request(self, req_id) -> None:
        """End a request: its tree is freed and its response joins the global tree (oldest evicted past the bound)."""
        if req_id not in self._local:
            raise ValueError(f"Request '{req_id}' is not active")
        _, response = self._local.pop(req_id)
        if self.max_cached_requests <= 0 or not response:
            return
        gid = self._next_global_id
        self._next_global_id = (gid + 1) & 0x7FFFFFFF  # the C++ tree keys sequences by int32
        if gid in self._cached:
            self._evict(gid, self._cached.pop(gid))
        self.engine.add(self.global_tree, gid, response)
        self._cached[gid] = array("i", response)  # 4 bytes per token (the python engine needs them to remove)
        self._cached_token_count += len(response)
        while len(self._cached) > self.max_cached_requests:
            self._evict(*self._cached.popitem(last=False))

    def _evict(self, gid, tokens) -> None:
        self.engine.remove(self.global_tree, gid, tokens)
        self._cached_token_count -= len(tokens)

    def speculate(self, req_id, context, max_spec_tokens: int, max_spec_factor: float = 1.0,
                  max_spec_offset: float = 0.0, min_token_prob: float = 0.1, use_global: bool = True) -> SuffixDraft:
        """Best draft of the request's tree and the global tree for the end of ``context`` (ties: the request's).

        ``context`` must end with the request's sequence so far; only its last max_tree_depth tokens are matched.
        ``use_global=False`` matches the request's tree only.
        """
        if req_id not in self._local:
            raise ValueError(f"Request '{req_id}' is not active")
        context = [int(t) for t in context[-self.max_tree_depth :]]
        args = (max_spec_tokens, max_spec_factor, max_spec_offset, min_token_prob)
        local = self.engine.speculate(self._local[req_id][0], context, True, *args)
        if not self._cached or not use_global:
            return local
        glob = self.engine.speculate(self.global_tree, context, False, *args)
        return glob if glob.score > local.score else local


def arctic_available() -> bool:
    """True when Arctic Inference's C++ suffix tree (``arctic_inference.suffix_decoding``) can be imported."""
    try:
        from arctic_inference.suffix_decoding._C import SuffixTree  # noqa: F401
    except ImportError:
        return False
    return True


BACKENDS = ("auto", "arctic", "python")


def make_cache(backend: str, max_tree_depth: int, max_cached_requests: int) -> SuffixCache:
    """The suffix decoding cache on ``backend``'s trees ("auto" = arctic when importable, else python).

    Raises:
        ValueError: unknown backend, or "arctic" requested but not installed (run scripts/build_suffix_tree.sh).
    """
    if backend not in BACKENDS:
        raise ValueError(f"suffix backend {backend!r}: allowed values are {', '.join(BACKENDS)}")
    if backend == "arctic" and not arctic_available():
        raise ValueError("suffix backend 'arctic' is not installed: run scripts/build_suffix_tree.sh")
    engine = "arctic" if backend in ("auto", "arctic") and arctic_available() else "python"
    return SuffixCache(engine, max_tree_depth, max_cached_requests)


class SuffixProposer:
    """Suffix-decoding proposer: a tree per active request plus a global tree of earlier responses.

    The step protocol sends a sequence's committed ids every step; the proposer feeds the cache only what is new
    (the first call for a sequence starts it with those ids as its prompt).

    Args:
        max_tree_depth: longest stored substring (default 64).
        max_cached_requests: responses kept in the global tree (FIFO eviction); 0 disables the global tree.
        max_spec_factor, max_spec_offset: at most floor(m * factor + offset) tokens for a match of length m.
        min_token_prob: stop speculating below this running probability.
        max_active: request trees kept at once (least recently used stopped first).
        backend: "auto" (Arctic's C++ cache when installed), "arctic" or "python" (see module docstring).

    Raises:
        ValueError: an invalid setting or an unavailable backend.
    """

    def __init__(self, max_tree_depth: int = 64, max_cached_requests: int = 10000, max_spec_factor: float = 1.0,
                 max_spec_offset: float = 0.0, min_token_prob: float = 0.1, max_active: int = 256,
                 backend: str = "auto"):
        if max_tree_depth < 1:
            raise ValueError(f"suffix max_tree_depth must be >= 1, got {max_tree_depth}")
        if max_cached_requests < 0:
            raise ValueError(f"suffix max_cached_requests must be >= 0, got {max_cached_requests}")
        if not 0.0 <= min_token_prob <= 1.0:
            raise ValueError(f"suffix min_token_prob must be in [0, 1], got {min_token_prob}")
        self.depth = max_tree_depth
        self.max_cached_requests = max_cached_requests
        self.factor, self.offset, self.min_prob = max_spec_factor, max_spec_offset, min_token_prob
        self.cache = make_cache(backend, max_tree_depth, max_cached_requests)
        self.backend = self.cache.engine.name
        self._ids: OrderedDict[int, list[int]] = OrderedDict()  # seq_id -> ids the cache has seen
        self.max_active = max_active

    def _sync(self, seq_id: int, token_ids: list[int]) -> None:
        known = self._ids.get(seq_id)
        if known is not None and token_ids[: len(known)] == known:
            if len(token_ids) > len(known):
                new = token_ids[len(known) :]
                self.cache.add_active_response(seq_id, new)
                known.extend(new)
            self._ids.move_to_end(seq_id)
            return
        if known is not None:  # the ids diverged from what the cache saw: start the sequence over
            self.release(seq_id)
        self.cache.start_request(seq_id, token_ids)
        self._ids[seq_id] = list(token_ids)
        while len(self._ids) > self.max_active:
            self.release(next(iter(self._ids)))

    def speculate(self, seq_id: int, token_ids: list[int], k: int, use_global: bool = True) -> SuffixDraft:
        """Best draft of the request's tree and the global tree for the end of ``token_ids`` (at most ``k`` tokens).

        Args:
            seq_id: the sequence (uint64).
            token_ids: its committed ids (prompt + output so far).
            k: most tokens to draft.
            use_global: also match earlier responses (False: the request's own tree only).
        """
        token_ids = [int(t) for t in token_ids]
        self._sync(seq_id, token_ids)
        return self.cache.speculate(seq_id, token_ids, k, self.factor, self.offset, self.min_prob, use_global)

    @staticmethod
    def uses_global_tree(params: SamplingParams | None) -> bool:
        """Whether a request's drafts may come from earlier responses: not for seeded sampling, whose output must be a
        function of the request alone (drafts change which tokens rejection sampling emits, though never their
        distribution); greedy output is the target's argmax walk whatever the drafts."""
        return params is None or params.is_greedy or not params.seeded

    def propose(self, seq_id: int, token_ids: list[int], k: int, params: SamplingParams, step: int) -> Proposal:
        """Up to ``k`` draft tokens from suffix matching (no draft probabilities)."""
        if k <= 0:
            return Proposal.empty()
        draft = self.speculate(seq_id, token_ids, k, self.uses_global_tree(params))
        return Proposal(torch.tensor(draft.token_ids, dtype=torch.int64), None)

    def update(self, seq_id: int, token_ids: list[int]) -> None:
        """Bring a running sequence's tree up to ``token_ids`` (e.g. the final ids, just before :meth:`release`)."""
        if seq_id in self._ids:
            self._sync(seq_id, [int(t) for t in token_ids])

    def release(self, seq_id: int) -> None:
        """End of a sequence: its tree is freed and its response stays in the global tree (FIFO-bounded)."""
        if self._ids.pop(seq_id, None) is not None:
            self.cache.stop_request(seq_id)

    def active_requests(self) -> int:
        """Request trees currently held."""
        return len(self._ids)

    def cached_requests(self) -> int:
        """Responses in the global tree."""
        return self.cache.cached_requests
