"""Suffix decoding's cache: a tree per active request and a global tree of earlier responses, on either engine.

:class:`SuffixCache` has the API of Arctic Inference's ``SuffixDecodingCache`` (``start_request``,
``add_active_response``, ``stop_request``, ``speculate``) and runs on one of two engines' trees:

- ``arctic`` (default when importable): Arctic Inference's C++ ``SuffixTree``, path-compressed with children kept in
  count order (``scripts/build_suffix_tree.sh`` builds it from the PyPI sdist). It matches at most len(context) - 1
  tokens and may break ties between equally frequent children differently. docs/benchmarks.md has its memory per
  cached token and time per speculate (``python -m bench.suffix_cache``).
- ``python``: :class:`~.tree.SuffixTree`, a pure-Python dictionary trie with the same semantics (no compiler
  needed). Updates cost O(max_tree_depth) per token, and text that never repeats adds up to max_tree_depth nodes per
  token, so it suits small caches only.

Either engine drafts a chain, or with ``use_tree_spec`` a token tree expanded best-first by running probability
(suffix decoding's speculation trees: Oliaro et al., "SuffixDecoding", arXiv 2411.04975), whose nodes come back in
:func:`~.tree.chain_first` order: topological, the most probable chain first.
"""

from __future__ import annotations

from array import array
from collections import OrderedDict
from collections.abc import Hashable, Sequence
from typing import Any, Protocol

from .tree import SuffixDraft, SuffixTree, chain_first, speculate


class _Engine(Protocol):
    """The trees of one engine, as :class:`SuffixCache` drives them (a tree is the engine's own type)."""

    name: str

    def new_tree(self) -> Any:
        """An empty tree."""

    def extend(self, tree: Any, tokens: list[int]) -> None:
        """Append ``tokens`` to the tree's current sequence (a request's tree)."""

    def add(self, tree: Any, seq_id: int, tokens: list[int]) -> None:
        """Insert a whole sequence, keyed by ``seq_id`` (int32; the global tree)."""

    def remove(self, tree: Any, seq_id: int, tokens: Sequence[int]) -> None:
        """Undo :meth:`add` of ``seq_id`` (``tokens``: what it added)."""

    def speculate(self, tree: Any, context: list[int], own: bool, k: int, factor: float, offset: float,
                  min_prob: float, use_tree: bool) -> SuffixDraft:
        """The tree's best draft for the end of ``context`` (:func:`~.tree.speculate`'s arguments); ``own``: the
        tree is the request's, whose current sequence is ``context``; ``use_tree``: a token tree in
        :func:`~.tree.chain_first` order, else a chain."""


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

    def remove(self, tree: SuffixTree, seq_id: int, tokens: Sequence[int]) -> None:
        tree.remove_sequence(list(tokens))

    def speculate(self, tree: SuffixTree, context: list[int], own: bool, k: int, factor: float, offset: float,
                  min_prob: float, use_tree: bool) -> SuffixDraft:
        nodes = tree.suffix_nodes() if own else None  # a request tree's current sequence is the context
        return speculate(tree, context, k, factor, offset, min_prob, nodes=nodes, use_tree=use_tree)


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

    def remove(self, tree, seq_id: int, tokens: Sequence[int]) -> None:
        tree.remove(seq_id)

    def speculate(self, tree, context: list[int], own: bool, k: int, factor: float, offset: float,
                  min_prob: float, use_tree: bool) -> SuffixDraft:
        # Arctic's parents are ours (-1: the context's last token; a node's parent comes before it)
        d = tree.speculate(context, k, factor, offset, min_prob, use_tree)
        draft = SuffixDraft(list(d.token_ids), list(d.probs), float(d.score), int(d.match_len), list(d.parents))
        return chain_first(draft) if use_tree else draft


class SuffixCache:
    """Suffix decoding's trees (the API of Arctic Inference's ``SuffixDecodingCache``) on either engine.

    Each active request has a tree over its prompt and response so far; a response joins the global tree when its
    request stops, after the oldest responses have left it (FIFO) until it fits both bounds: at most
    ``max_cached_requests`` responses and, when ``max_cached_tokens`` > 0, at most ``max_cached_tokens`` tokens (the
    global tree's memory grows with its tokens, so the token budget bounds it whatever the responses' lengths). A
    response longer than the whole token budget joins truncated to its last ``max_cached_tokens`` tokens (the most
    recent text), alone in the tree. Unlike Arctic's own cache, which inserts a response into the global tree while it
    is generated, the global tree never holds the request's current occurrence of its context, so an exact repeat of
    an earlier response is drafted with probability 1 per token (score = k) instead of 1/2, which hybrid's
    "score >= k" rule needs.

    Args:
        engine: "python" (:class:`SuffixTree`) or "arctic" (Arctic's C++ tree).
        max_tree_depth: longest stored substring (>= 1).
        max_cached_requests: responses kept in the global tree; 0 disables it.
        max_cached_tokens: tokens kept in the global tree (>= 0; 0 = no token bound); :meth:`cached_tokens` never
            exceeds it after a call returns.

    Raises:
        ValueError: ``max_cached_tokens`` < 0; (methods) starting an active request again, or using a request that is
            not active.
    """

    def __init__(self, engine: str, max_tree_depth: int = 64, max_cached_requests: int = 10000,
                 max_cached_tokens: int = 0):
        if max_cached_tokens < 0:
            raise ValueError(f"max_cached_tokens must be >= 0 (0 = no token bound), got {max_cached_tokens}")
        self.engine: _Engine = _ArcticEngine(max_tree_depth) if engine == "arctic" else _PythonEngine(max_tree_depth)
        self.max_tree_depth = max_tree_depth
        self.max_cached_requests = max_cached_requests
        self.max_cached_tokens = max_cached_tokens
        self.global_tree = self.engine.new_tree()
        self._local: dict[Hashable, tuple[Any, list[int]]] = {}  # req_id -> (tree over prompt + response, response)
        self._cached: OrderedDict[int, array] = OrderedDict()  # global seq id -> response tokens, oldest first
        self._next_global_id = 0
        self._cached_token_count = 0

    @property
    def cached_requests(self) -> int:
        """Number of responses in the global tree."""
        return len(self._cached)

    def cached_tokens(self) -> int:
        """Tokens in the global tree (its memory grows with them); at most ``max_cached_tokens`` when that is > 0."""
        return self._cached_token_count

    def start_request(self, req_id, prompt_token_ids) -> None:
        """Begin a request: its tree holds the prompt (ValueError if it is active already)."""
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
        """End a request: its tree is freed and its response joins the global tree, after the oldest responses have
        left it until the response fits ``max_cached_requests`` and ``max_cached_tokens`` (a response longer than the
        token budget: its last ``max_cached_tokens`` tokens). Evicting first keeps the tree's peak within the bounds.

        Raises:
            ValueError: ``req_id`` is not active.
        """
        if req_id not in self._local:
            raise ValueError(f"Request '{req_id}' is not active")
        _, response = self._local.pop(req_id)
        if self.max_cached_requests <= 0 or not response:
            return
        budget = self.max_cached_tokens
        if budget > 0 and len(response) > budget:
            response = response[-budget:]
        gid = self._next_global_id
        self._next_global_id = (gid + 1) & 0x7FFFFFFF  # the C++ tree keys sequences by int32
        if gid in self._cached:
            self._evict(gid, self._cached.pop(gid))
        while self._cached and (len(self._cached) >= self.max_cached_requests
                                or (budget > 0 and self._cached_token_count + len(response) > budget)):
            self._evict(*self._cached.popitem(last=False))
        self.engine.add(self.global_tree, gid, response)
        self._cached[gid] = array("i", response)  # 4 bytes per token (the python engine needs them to remove)
        self._cached_token_count += len(response)

    def _evict(self, gid, tokens) -> None:
        self.engine.remove(self.global_tree, gid, tokens)
        self._cached_token_count -= len(tokens)

    def speculate(self, req_id, context, max_spec_tokens: int, max_spec_factor: float = 1.0,
                  max_spec_offset: float = 0.0, min_token_prob: float = 0.1, use_global: bool = True,
                  use_tree_spec: bool = False) -> SuffixDraft:
        """Best draft of the request's tree and the global tree for the end of ``context`` (ties: the request's).

        Args:
            req_id: an active request.
            context: token ids ending with the request's sequence so far; only the last max_tree_depth are matched.
            max_spec_tokens, max_spec_factor, max_spec_offset, min_token_prob: the draft's bounds
                (:func:`~.tree.speculate`).
            use_global: False matches the request's tree only.
            use_tree_spec: draft a token tree (expanded best-first, at most ``max_spec_tokens`` nodes, the most
                probable chain first: :func:`~.tree.chain_first`), as Arctic's argument of that name; else a chain.

        Raises:
            ValueError: ``req_id`` is not active.
        """
        if req_id not in self._local:
            raise ValueError(f"Request '{req_id}' is not active")
        context = [int(t) for t in context[-self.max_tree_depth :]]
        args = (max_spec_tokens, max_spec_factor, max_spec_offset, min_token_prob, use_tree_spec)
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


BACKENDS = ("auto", "arctic", "python")  # suffix_backend's values


def make_cache(backend: str, max_tree_depth: int, max_cached_requests: int, max_cached_tokens: int = 0) -> SuffixCache:
    """The suffix decoding cache on ``backend``'s trees: one of :data:`BACKENDS` (as
    :class:`~.proposer.SuffixSettings` checks it), "auto" = arctic when importable, else python; the other arguments
    are :class:`SuffixCache`'s.

    Raises:
        ValueError: "arctic" requested but not installed (run scripts/build_suffix_tree.sh); ``max_cached_tokens`` < 0.
    """
    if backend == "arctic" and not arctic_available():
        raise ValueError("suffix backend 'arctic' is not installed: run scripts/build_suffix_tree.sh")
    engine = "arctic" if backend in ("auto", "arctic") and arctic_available() else "python"
    return SuffixCache(engine, max_tree_depth, max_cached_requests, max_cached_tokens)
