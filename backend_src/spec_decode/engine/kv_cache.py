"""A causal LM over a paged KV pool: per-sequence page lists that reuse the longest cached prefix, within a sequence
and across them, and rounds run at static shapes (CUDA graphs on a GPU).

Used by the target scorer and the draft LM proposer. Each call names a sequence and the full token list whose last
``n_logits`` positions' logits it needs. The sequence's pages are cut to the longest common prefix of what they hold
and the new tokens (rollback after a rejection is a length change: no data moves, pages wholly beyond go back to the
pool) and only the rest is computed. A cache miss costs time, never correctness.

Prefix caching across requests (vLLM's automatic prefix caching): full pages of ``block_size`` tokens are registered
under a chain of their token ids (:mod:`.pages`), so a sequence whose tokens start with the same blocks as another's,
running or released, shares those pages (reference counted; a shared page written again is copied first) instead of
computing them. Released sequences' full pages stay cached until the pool needs them, least recently used first out.
The pool holds ``max_tokens`` positions; when a round needs pages and none is free, cached pages go first, then the
least recently used running sequences outside the round (their next step recomputes them).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..sequences import SequenceLRU, common_prefix_len
from ..settings import InvalidInputError
from ..tree import check_tree
from .aux_states import AuxHiddenStates
from .blocks import PrefixCacheStats
from .cuda_graphs import CUDA_GRAPHS, round_graphs
from .invariant_attention import MIN_ROWS_LINEAR, use_invariant_attention
from .kv_pool import KVPool, kv_shape, pool_tokens
from .paged_forward import (
    BATCH_BUCKETS,
    QUERY_BUCKETS,
    PagedForward,
    RoundRow,
    RoundShape,
    bucket,
    pack_round,
    span_of,
    split_by_padding,
    tree_paths,
    unpack_round,
)
from .pages import ROOT_KEY, BlockManager, OutOfPages, PagedSequence
from .tree_slots import keep_accepted_path, row_parents

logger = logging.getLogger(__name__)


class KVCacheFull(RuntimeError):
    """A round's own sequences need more pages than the pool has (``kv_cache_max_tokens``)."""


@dataclass
class _Work:
    """One call of a round: its sequence, the tokens, and the host-side row."""

    seq_id: int
    seq: PagedSequence
    ids: list[int]
    row: RoundRow
    tree: list[int] | None = None  # a draft tree's parents: its nodes are the last len(tree) ids


class CachedCausalLM:
    """Wraps a Hugging Face causal LM with a paged KV pool, per-sequence page lists (LRU over ``max_sequences``) and
    rounds at static shapes.

    Every forward (one sequence, or a batched round) writes the new keys and values into the sequences' pages and reads
    each row's context through its block table, under a 4D mask built on the device (:mod:`.paged_forward`); nothing is
    copied per step, unlike a transformers ``DynamicCache``, which concatenates its whole cache every step
    (docs/benchmarks.md has the measurement). On CUDA the round's forward is captured as CUDA graphs at load, one per
    padded shape (batch 1..64, query length 1, 2, 3, 5, 9, context up to 8,192 positions; ``cuda_graphs``), and
    replayed; other shapes, and every shape on a CPU, run the same function eagerly. Full-attention models only (the
    Llama, Mistral and Qwen2 families without sliding-window layers).

    Args:
        model: a transformers ``*ForCausalLM`` in eval mode.
        max_sequences: most running sequences with pages; the least recently used loses them beyond it (>= 1).
        max_batched_new_tokens: in :meth:`logits_batch`, sequences with more new tokens than this run alone.
        max_padded_positions: in :meth:`logits_batch`, sequences are split into separate forwards where reading every
            row over the longest row's context would read more than this many padded (row x position) slots.
        max_tokens: positions of the pool (0: sized from the device's memory, :func:`~.kv_pool.pool_tokens`).
            Memory: this x :meth:`kv_bytes_per_token`.
        prefix_caching: share full pages across sequences (module docstring).
        block_size: positions per page (>= 1; vLLM's default 16).
        aux_layers: decoder layers whose inputs the hidden states carry after the last one (EAGLE-3's;
            :class:`~.aux_states.AuxHiddenStates`).
        cuda_graphs: ``auto`` (capture on CUDA; a failed capture is logged and every round runs eagerly), ``on``
            (the same, but a failed capture raises), ``emulate`` (on any device, a round a graph would replay runs
            eagerly at the captured shape: :class:`~.cuda_graphs.EagerAtShapes`, the captured path's code on a CPU)
            or ``off``.
        gpu_memory_utilization: on CUDA, the fraction of the device's memory the process may fill with the pool.
        pad_shapes: pad every round to the bucketed batch and query sizes (always so for a captured round; by default
            eager rounds run at their exact sizes, which a CPU computes faster).
        batch_invariant: every position's logits bit for bit alike whatever else the round holds
            (:mod:`.invariant_attention`, rounds of at least ``MIN_ROWS_LINEAR`` rows), so speculative greedy output is
            plain decoding's; ``auto``: on a CPU in a dtype other than float32 (whose kernels agree to ~1e-5 there).

    Thread safety: calls are serialised by a lock (one forward at a time per model instance).

    Raises:
        ValueError: ``max_sequences`` or ``block_size`` < 1, ``max_tokens`` < 0, ``cuda_graphs`` unknown, or a pool
            that does not fit (:func:`~.kv_pool.pool_tokens`).
        NotImplementedError: a model with sliding-window or other non-full-attention layers.
    """

    def __init__(self, model, max_sequences: int = 64, max_batched_new_tokens: int = 16,
                 max_padded_positions: int = 2048, max_tokens: int = 0, prefix_caching: bool = True,
                 block_size: int = 16, aux_layers: tuple[int, ...] = (), cuda_graphs: str = "auto",
                 gpu_memory_utilization: float = 0.9, pad_shapes: bool = False, batch_invariant: bool | str = "auto"):
        if max_sequences < 1:
            raise ValueError(f"max_sequences must be >= 1, got {max_sequences}")
        if max_tokens < 0:
            raise ValueError(f"max_tokens must be >= 0 (0 = from the device's memory), got {max_tokens}")
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        if cuda_graphs not in CUDA_GRAPHS:
            raise ValueError(f"cuda_graphs must be one of {', '.join(CUDA_GRAPHS)}, got {cuda_graphs!r}")
        types = set(getattr(model.config, "layer_types", None) or ["full_attention"])
        if types != {"full_attention"}:
            raise NotImplementedError(f"CachedCausalLM supports full-attention models only; this one has layer types "
                                      f"{sorted(types)}")
        self.model = model
        self.prefix_caching = prefix_caching
        self.block_size = block_size
        self.prefix_stats = PrefixCacheStats()
        self.max_batched_new_tokens = max_batched_new_tokens
        self.max_padded_positions = max_padded_positions
        self.pad_shapes = pad_shapes
        first = next(model.parameters())
        self.device, self.dtype = first.device, first.dtype
        if batch_invariant == "auto":
            batch_invariant = self.device.type == "cpu" and self.dtype != torch.float32
        self.batch_invariant = bool(batch_invariant)
        if self.batch_invariant:
            use_invariant_attention(model)
        self.vocab_size = int(model.config.vocab_size)
        self.max_positions = int(getattr(model.config, "max_position_embeddings", 0) or 0)  # 0: no bound known
        layers, kv_heads, head_dim = kv_shape(model.config)
        tokens = pool_tokens(max_tokens, self.kv_bytes_per_token(), self.device, gpu_memory_utilization)
        num_pages = -(-tokens // block_size) + 1  # + the trash page
        self.max_tokens = (num_pages - 1) * block_size
        self.pool = KVPool(layers, kv_heads, head_dim, num_pages, block_size, self.dtype, self.device)
        self.pages = BlockManager(num_pages, block_size)
        self._aux = AuxHiddenStates(model.get_decoder(), list(aux_layers))  # hidden states gain these layers' inputs
        self._forward_fn = PagedForward(model, self.pool, self._aux)
        self._seqs: SequenceLRU[PagedSequence] = SequenceLRU(max_sequences, on_evict=self._evicted)
        self._lock = threading.Lock()
        self.graphs = round_graphs(cuda_graphs, self._forward_fn, self.device, max_sequences, self.max_positions,
                                   block_size)

    # -- accounting ----------------------------------------------------------------------------------------------

    def __len__(self) -> int:
        """Running sequences with pages (cached pages of released ones are not counted)."""
        return len(self._seqs)

    def cached_tokens(self) -> int:
        """Tokens held by the running sequences."""
        with self._lock:
            return sum(len(s.ids) for s in self._seqs.values())

    def allocated_tokens(self) -> int:
        """Positions of the pages in use, running sequences' and cached ones (at most ``max_tokens``)."""
        return self.pages.used_pages() * self.block_size

    def cached_pages(self) -> int:
        """Pages no running sequence holds, kept for prefix reuse."""
        return self.pages.cached_pages()

    def kv_bytes_per_token(self) -> int:
        """Bytes of keys and values one cached position takes: 2 x layers x KV heads x head dim x the dtype's size
        (the pool's shape)."""
        layers, heads, head_dim = kv_shape(self.model.config)
        return 2 * layers * heads * head_dim * torch.empty((), dtype=self.dtype).element_size()

    def cached_ids(self, seq_id: int) -> list[int] | None:
        """Tokens currently held for ``seq_id`` (None when it has no pages)."""
        s = self._seqs.peek(seq_id)
        return None if s is None else list(s.ids)

    def held_prefix_len(self, seq_id: int, token_ids: list[int]) -> int:
        """Leading ``token_ids`` a forward of ``seq_id`` over them would reuse instead of computing: the common prefix
        with what the sequence holds, extended by the registered full pages of the prefix index that follow it; at most
        all but the last token. Nothing changes (no page is taken, no LRU order moves): what chunked prefill budgets
        by (:meth:`~.scorer.TargetScorer.chunk_end`)."""
        limit = len(token_ids) - 1
        with self._lock:
            seq = self._seqs.peek(seq_id)
            keep = min(common_prefix_len(seq.ids, token_ids), limit) if seq is not None else 0
            ps = self.block_size
            if not self.prefix_caching or limit - keep < ps:  # as _prepare: too little left to look up
                return max(keep, 0)
            j = keep // ps
            parent = self.pages.block_key(seq, j - 1) if seq is not None else ROOT_KEY
            found = self.pages.cached_run(parent, token_ids, j, limit)
            return (j + len(found)) * ps if found else keep

    def release(self, seq_id: int) -> bool:
        """End ``seq_id``: its pages go back to the pool, full registered ones cached for prefix reuse (while the
        pool does not need them). Returns whether it had any."""
        with self._lock:
            s = self._seqs.pop(seq_id)
            if s is not None:
                self.pages.release(s)
            return s is not None

    def _evicted(self, seq_id: int, seq: PagedSequence) -> None:
        self.pages.release(seq)

    # -- forwards ------------------------------------------------------------------------------------------------

    @torch.inference_mode()
    def logits(self, seq_id: int, token_ids: list[int], n_logits: int) -> torch.Tensor:
        """Logits after each of the last ``n_logits`` tokens of ``token_ids``.

        Args:
            seq_id: sequence identifier (uint64).
            token_ids: the full token list (prompt + committed + any drafts), length L >= n_logits.
            n_logits: how many final positions to return (1 for plain decoding, k+1 for scoring k drafts).

        Returns:
            [n_logits, V] logits (model dtype) on the model's device; row j predicts the token after
            ``token_ids[L - n_logits + j]``.

        Raises:
            ValueError: (:class:`~spec_decode.settings.InvalidInputError`) ``n_logits`` outside [1, L], L beyond the
                model's ``max_position_embeddings``, or a token id outside [0, V).
            KVCacheFull: the sequence alone needs more pages than the pool has.
        """
        return self.logits_batch([(seq_id, token_ids, n_logits)])[0]

    @torch.inference_mode()
    def logits_batch(self, calls: list[tuple], hidden: bool = False, reused: list[int] | None = None) -> list:
        """:meth:`logits` for several sequences in one forward pass (continuous batching of decode steps).

        Sequences with at most ``max_batched_new_tokens`` tokens to compute (decode and scoring steps) run together,
        one row each, their new tokens from column 0, padded to the longest; a 4D mask keeps every row to its own
        tokens. Longer work (a prefill, a cache miss) runs alone, and sequences whose contexts differ too much in
        length run in separate forwards (:func:`~.paged_forward.split_by_padding`: about one forward's cost in padding,
        ``max_padded_positions``; docs/benchmarks.md has the measurement).

        Args:
            calls: (seq_id, token_ids, n_logits) per sequence, as for :meth:`logits`, or (seq_id, token_ids, n_logits,
                parents) where the last ``len(parents)`` token ids are a draft tree (:mod:`spec_decode.tree`; parents
                checked, None: a chain) scored under the tree mask, ``n_logits`` = nodes + 1 (row i + 1 follows node
                i); the next call keeps the accepted path's keys and values (:mod:`.tree_slots`). seq_ids distinct.
            hidden: also return the last hidden states of those positions (the decoder's output, after its final norm:
                what the LM head reads; with aux layers, their inputs after it).
            reused: a list that receives, per call in order, the leading tokens its forward reused from the cache
                (its own pages or the prefix index's) instead of computing them.

        Returns:
            per call, [n_logits, V] logits (model dtype) on the model's device; with ``hidden``, (logits, hidden
            [n_logits, H]) pairs.

        Raises:
            ValueError: as :meth:`logits` (checked for every call before any forward), or a repeated seq_id.
            KVCacheFull: the round's sequences together need more pages than the pool has.
        """
        for _, ids, n, *tree in calls:
            self.check(ids, n)
            if tree and tree[0] is not None:
                if len(tree[0]) + 1 != n:
                    raise ValueError(f"logits_batch: a tree of {len(tree[0])} nodes scores {len(tree[0]) + 1} rows")
                check_tree(ids[len(ids) - len(tree[0]):], tree[0])
        if len({c[0] for c in calls}) != len(calls):
            raise ValueError("logits_batch: every sequence may appear once per batch")
        with self._lock:
            protect = {c[0] for c in calls}
            work = [self._prepare(seq_id, list(ids), n, protect, tree[0] if tree else None)
                    for seq_id, ids, n, *tree in calls]
            if reused is not None:
                reused += [w.row.cached for w in work]
            out: list[tuple[torch.Tensor, torch.Tensor] | None] = [None] * len(calls)
            alone = [i for i, w in enumerate(work) if len(w.row.new_ids) > self.max_batched_new_tokens]
            together = [i for i, w in enumerate(work) if len(w.row.new_ids) <= self.max_batched_new_tokens]
            try:
                groups = split_by_padding({i: work[i].row for i in together}, self.max_padded_positions)
                for group in [[i] for i in alone] + groups:
                    for i, result in zip(group, self._forward([work[i].row for i in group])):
                        out[i] = result
            except Exception:
                for w in work:  # pages half written: start these sequences again
                    if self._seqs.pop(w.seq_id) is not None:
                        self.pages.release(w.seq)
                raise
            for w in work:
                w.seq.ids = w.ids if w.tree is None else w.ids[: len(w.ids) - len(w.tree)]
                if w.tree is not None:  # its nodes stay in the slots after the committed ids until the next call
                    w.seq.tree = (len(w.seq.ids), w.ids[len(w.seq.ids):], list(w.tree))
                if self.prefix_caching:
                    self.pages.register(w.seq)
        done = [o for o in out if o is not None]
        assert len(done) == len(out)  # every call ran, alone or in a group
        return done if hidden else [lg for lg, _ in done]

    def round_shape(self, rows: list[RoundRow]) -> tuple[RoundShape, bool]:
        """The shape a round of ``rows`` runs at, and whether a captured CUDA graph runs it: the smallest captured
        shape that holds it, else the eager shape (exact sizes, or bucketed with ``pad_shapes``; query lengths past
        the largest bucket rounded up to a page)."""
        b = len(rows)
        q = max(len(r.new_ids) for r in rows)
        o = max(r.n_logits for r in rows)
        p = max(len(r.pages) for r in rows)
        tree = any(r.parents is not None for r in rows)
        if self.graphs is not None:
            shape = self.graphs.shape_for(b, q, o, p, tree)
            if shape is not None:
                return shape, True
        if self.pad_shapes:
            b = bucket(b, BATCH_BUCKETS)
            q = bucket(q, QUERY_BUCKETS) if q <= QUERY_BUCKETS[-1] else -(-q // self.block_size) * self.block_size
        if self.batch_invariant and b * o < MIN_ROWS_LINEAR:  # a one-row product runs another kernel
            q, o = max(q, -(-MIN_ROWS_LINEAR // b)), -(-MIN_ROWS_LINEAR // b)
        return RoundShape(b, q, o, p, tree), False

    def _forward(self, rows: list[RoundRow]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """One forward over ``rows`` at their round shape; per row its (logits [n_logits, V], hidden [n_logits, H'])."""
        shape, captured = self.round_shape(rows)
        packed = pack_round(rows, shape, self.block_size)
        if captured:
            assert self.graphs is not None
            logits, hidden = self.graphs.run(packed, shape)
            logits, hidden = logits.clone(), hidden.clone()  # the next replay overwrites the graph's outputs
        else:
            flat = torch.from_numpy(packed)
            if self.device.type != "cpu":
                flat = flat.pin_memory().to(self.device, non_blocking=True)
            paths = tree_paths(rows, shape, self.device) if shape.tree and self.batch_invariant else None
            logits, hidden = self._forward_fn.run(unpack_round(flat, shape), span=span_of(rows, shape, self.block_size),
                                                  paths=paths)
        return [(logits[r, : row.n_logits], hidden[r, : row.n_logits]) for r, row in enumerate(rows)]

    # -- pages -----------------------------------------------------------------------------------------------------

    def check(self, token_ids: list[int], n_logits: int) -> None:
        """Raise :class:`~spec_decode.settings.InvalidInputError` (a ValueError naming the bound) unless
        :meth:`logits` accepts ``token_ids`` and ``n_logits``."""
        if not 1 <= n_logits <= len(token_ids):
            raise InvalidInputError("n_logits", f"must be in [1, {len(token_ids)}], got {n_logits}")
        if self.max_positions and len(token_ids) > self.max_positions:
            raise InvalidInputError("token_ids", f"{len(token_ids)} tokens (with the drafts); the model takes at most "
                                                 f"{self.max_positions} positions")
        if min(token_ids) < 0 or max(token_ids) >= self.vocab_size:
            raise InvalidInputError("token_ids", f"token ids must lie in [0, {self.vocab_size}), got "
                                                 f"{min(token_ids)}..{max(token_ids)}")

    def _prepare(self, seq_id: int, ids: list[int], n_logits: int, protect: set[int],
                 tree: list[int] | None = None) -> _Work:
        """The sequence cut to its reusable prefix (a rollback; a previous draft tree's accepted path kept first),
        extended by shared cached pages, its partial page made writable and pages given for its new tokens; returns
        the round's row for it (``tree``: the parents of its last ``len(tree)`` ids, a draft tree)."""
        seq = self._seqs.get(seq_id, PagedSequence)
        keep_accepted_path(seq, ids, self.pool, self.block_size)
        limit = len(ids) - n_logits
        keep = min(common_prefix_len(seq.ids, ids), limit)
        self.pages.truncate(seq, keep)
        if self.prefix_caching and limit - keep >= self.block_size:
            keep = self.pages.reuse_prefix(seq, ids, keep, limit, self.prefix_stats)
        copy = self._with_pages(protect, lambda: self.pages.writable(seq))
        if copy is not None:
            self.pool.copy_prefix(copy[0], copy[1], keep % self.block_size)
        self._with_pages(protect, lambda: self.pages.grow(seq, len(ids)))
        row = RoundRow(list(seq.pages), keep, ids[keep:], n_logits, row_parents(len(ids) - keep, tree))
        return _Work(seq_id, seq, ids, row, tree)

    def _with_pages(self, protect: set[int], action: Callable):
        """``action()``, evicting least recently used running sequences outside ``protect`` while the pool has no
        page for it.

        Raises:
            KVCacheFull: every other sequence is gone and the pool still has no page.
        """
        while True:
            try:
                return action()
            except OutOfPages:
                victim = next((s for s in self._seqs if s not in protect), None)
                if victim is None:
                    raise KVCacheFull(f"the KV pool ({self.max_tokens} tokens: kv_cache_max_tokens) cannot hold this "
                                      f"round's {len(protect)} sequences") from None
                seq = self._seqs.pop(victim)
                assert seq is not None
                self.pages.release(seq)


__all__ = ["CachedCausalLM", "KVCacheFull"]
