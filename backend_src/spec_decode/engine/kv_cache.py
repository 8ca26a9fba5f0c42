"""A causal LM with per-sequence KV caches that reuse the longest cached prefix, within a sequence and across them.

Used by the target scorer and the draft LM proposer. Each call names a sequence and the full token list whose last
``n_logits`` positions' logits it needs. The cache of that sequence is cropped to the longest common prefix of what it
holds and the new tokens (rollback after a rejection is just this crop) and only the rest is computed. A cache miss
costs time, never correctness.

Prefix caching across requests (vLLM's automatic prefix caching, keyed the same way): every cache's full blocks of
``block_size`` tokens are indexed by a hash chain over the token ids (block i's key hashes block i-1's key and block
i's ids), so a sequence whose tokens start with the same blocks as any other cache, running or released, copies those
blocks' keys and values instead of computing them. Released caches stay for that reuse, least recently used first out.
Caches are bounded by count (``max_sequences``, LRU) and together by the positions they allocate (``max_tokens``).
The buffers are in :mod:`.slots`, the block keys in :mod:`.blocks`.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Collection
from dataclasses import dataclass, field

import torch

from ..settings import InvalidInputError
from .aux_states import AuxHiddenStates
from .blocks import PrefixCacheStats, block_hashes, common_prefix_len
from .lru import SequenceLRU
from .slots import RoundCache, SlotCache, cache_keyword


@dataclass
class _Entry:
    ids: list[int] = field(default_factory=list)  # tokens whose keys/values are at positions 0.. of ``slots``
    slots: SlotCache = field(default_factory=lambda: SlotCache())
    hashes: list[int] = field(default_factory=list)  # block_hashes(ids): the keys under which it is indexed


class CachedCausalLM:
    """Wraps a Hugging Face causal LM with an LRU of per-sequence KV caches (:class:`SlotCache`).

    Every forward (one sequence, or a batched round) gets its keys and values from the sequences' own buffers and
    writes the new ones into them in place, under an explicit 4D mask and position ids: no cache is copied per step,
    unlike a transformers ``DynamicCache``, which concatenates its whole cache every step (docs/benchmarks.md has the
    measurement). Full-attention models only (the Llama, Mistral and Qwen2 families without sliding-window layers).

    Prefix caching (the module docstring): a computation of at least one full block first copies the longest run of
    leading full blocks that another cache (running or released) holds for the same token ids, checked id by id (a
    hash collision can cost a lookup, never a wrong key). Released caches are kept for this, at most
    ``max_sequences`` of them, least recently used (or reused) out first.

    Args:
        model: a transformers ``*ForCausalLM`` in eval mode.
        max_sequences: most sequences cached at once; the least recently used is evicted beyond it (>= 1); as many
            released caches are kept for prefix reuse.
        max_batched_new_tokens: in :meth:`logits_batch`, sequences with more new tokens than this run alone.
        max_padded_positions: in :meth:`logits_batch`, sequences are split into separate forwards where left-padding
            their caches to a common length would leave more padded (row x position) slots than this.
        max_tokens: the most positions all caches together may allocate (0: no bound), kept after every forward:
            released caches are evicted first, then the least recently used running sequences; the sequences of the
            forward itself are never evicted by it, so one round may exceed it by its own sequences' growth. The
            memory it implies is ``max_tokens x`` :meth:`kv_bytes_per_token`.
        prefix_caching: reuse full blocks across sequences (above).
        block_size: tokens per block of prefix caching (>= 1; vLLM's default 16).
        aux_layers: decoder layers whose inputs the hidden states carry after the last one (EAGLE-3's;
            :class:`~.aux_states.AuxHiddenStates`).

    Thread safety: calls are serialised by a lock (one forward at a time per model instance).

    Raises:
        ValueError: ``max_sequences`` or ``block_size`` < 1, or ``max_tokens`` < 0.
        NotImplementedError: a model with sliding-window or other non-full-attention layers.
    """

    def __init__(self, model, max_sequences: int = 64, max_batched_new_tokens: int = 16,
                 max_padded_positions: int = 2048, max_tokens: int = 0, prefix_caching: bool = True,
                 block_size: int = 16, aux_layers: tuple[int, ...] = ()):
        if max_sequences < 1:
            raise ValueError(f"max_sequences must be >= 1, got {max_sequences}")
        if max_tokens < 0:
            raise ValueError(f"max_tokens must be >= 0 (0 = no bound), got {max_tokens}")
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.model = model
        self.max_tokens = max_tokens
        self.prefix_caching = prefix_caching
        self.block_size = block_size
        self.prefix_stats = PrefixCacheStats()
        self.max_batched_new_tokens = max_batched_new_tokens
        self.max_padded_positions = max_padded_positions
        first = next(model.parameters())
        self.device, self.dtype = first.device, first.dtype
        types = set(getattr(model.config, "layer_types", None) or ["full_attention"])
        if types != {"full_attention"}:
            raise NotImplementedError(f"CachedCausalLM supports full-attention models only; this one has layer types "
                                      f"{sorted(types)}")
        self.vocab_size = int(model.config.vocab_size)
        self.max_positions = int(getattr(model.config, "max_position_embeddings", 0) or 0)  # 0: no bound known
        # The forward runs the decoder and the LM head apart, so that a scoring step also gets the last hidden states
        # (what a hidden-state speculator reads) for the positions it keeps, as ``*ForCausalLM.forward`` itself does.
        self._decoder, self._head = model.get_decoder(), model.get_output_embeddings()
        self._cache_kw = cache_keyword(self._decoder)
        self._aux = AuxHiddenStates(self._decoder, list(aux_layers))  # hidden states gain these layers' inputs
        self._entries: SequenceLRU[_Entry] = SequenceLRU(max_sequences, on_evict=self._retire)
        self._retired: OrderedDict[int, _Entry] = OrderedDict()  # released caches kept for prefix reuse, LRU first
        self._retired_keys: dict[int, int] = {}  # id(entry) -> its key in _retired
        self._next_retired = 0
        self._index: dict[int, _Entry] = {}  # block key (block_hashes) -> a cache that holds that block
        self._lock = threading.Lock()

    def __len__(self) -> int:
        """Sequences cached (running; released caches kept for prefix reuse are not counted)."""
        return len(self._entries)

    def cached_tokens(self) -> int:
        """Tokens held in the running sequences' caches."""
        with self._lock:
            return sum(len(e.ids) for e in self._entries.values())

    def allocated_tokens(self) -> int:
        """Positions allocated by all caches, running and released (what ``max_tokens`` bounds; memory is this x
        :meth:`kv_bytes_per_token`)."""
        with self._lock:
            return self._allocated()

    def retired_sequences(self) -> int:
        """Released caches kept for prefix reuse."""
        return len(self._retired)

    def kv_bytes_per_token(self) -> int:
        """Bytes of keys and values one cached position takes: 2 x layers x KV heads x head dim x the dtype's size
        (from the model's config; the buffers are allocated with exactly these shapes)."""
        c = self.model.config
        heads = getattr(c, "num_key_value_heads", None) or c.num_attention_heads
        head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
        return 2 * c.num_hidden_layers * heads * head_dim * torch.empty((), dtype=self.dtype).element_size()

    def _allocated(self) -> int:
        return (sum(e.slots.capacity for e in self._entries.values())
                + sum(e.slots.capacity for e in self._retired.values()))

    def _unindex(self, e: _Entry, start: int = 0) -> None:
        """Drop ``e``'s blocks from ``start`` on from the prefix index (its ids there are about to change)."""
        for h in e.hashes[start:]:
            if self._index.get(h) is e:
                del self._index[h]
        del e.hashes[start:]

    def _retire(self, seq_id: int, e: _Entry) -> None:
        """A running sequence's cache leaves (released, or evicted by ``max_sequences``): kept for prefix reuse when
        it holds a full block, the least recently used released cache out beyond ``max_sequences`` of them."""
        if not self.prefix_caching or not e.hashes:
            self._unindex(e)
            return
        key, self._next_retired = self._next_retired, self._next_retired + 1
        self._retired[key] = e
        self._retired_keys[id(e)] = key
        while len(self._retired) > self._entries.capacity:
            self._drop_retired()

    def _drop_retired(self) -> None:
        _, old = self._retired.popitem(last=False)
        self._retired_keys.pop(id(old), None)
        self._unindex(old)

    def _enforce_budget(self, protect: Collection[int]) -> None:
        """Evict until all caches allocate at most ``max_tokens`` positions: released caches first (least recently
        used first), then running sequences other than ``protect`` (seq_ids), least recently used first."""
        if not self.max_tokens:
            return
        total = self._allocated()
        while total > self.max_tokens and self._retired:
            total -= next(iter(self._retired.values())).slots.capacity
            self._drop_retired()
        for seq_id in list(self._entries):
            if total <= self.max_tokens:
                break
            if seq_id in protect:
                continue
            e = self._entries.pop(seq_id)
            assert e is not None  # listed just above
            total -= e.slots.capacity
            self._unindex(e)

    def _reuse_prefix(self, e: _Entry, token_ids: list[int], keep: int, limit: int) -> int:
        """Copy into ``e`` (which holds ``token_ids[:keep]``) the longest run of leading full blocks of
        ``token_ids[:limit]`` that another cache holds; returns the positions ``e`` now holds."""
        b = self.block_size
        self.prefix_stats.queries += 1
        keys = block_hashes(token_ids[:limit], b)
        for i in range(len(keys) - 1, -1, -1):
            end = (i + 1) * b
            if end <= keep:
                break
            src = self._index.get(keys[i])
            if (src is None or src is e or len(src.hashes) <= i or src.hashes[i] != keys[i]
                    or src.ids[:end] != token_ids[:end]):
                continue
            e.slots.copy_from(src.slots, keep, end)
            self.prefix_stats.hits += 1
            self.prefix_stats.reused_tokens += end - keep
            key = self._retired_keys.get(id(src))
            if key is not None:  # a released cache just reused: it leaves last
                self._retired.move_to_end(key)
            e.ids = list(token_ids[:end])
            return end
        return keep

    def cached_ids(self, seq_id: int) -> list[int] | None:
        """Tokens currently held in the cache of ``seq_id`` (None when absent)."""
        e = self._entries.peek(seq_id)
        return None if e is None else list(e.ids)

    def release(self, seq_id: int) -> bool:
        """End the cache of ``seq_id``: with prefix caching it is kept for reuse by later sequences (bounded by
        ``max_sequences`` released caches and ``max_tokens``), else freed. Returns whether there was one."""
        with self._lock:
            e = self._entries.pop(seq_id)
            if e is not None:
                self._retire(seq_id, e)
            return e is not None

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
        """
        self.check(token_ids, n_logits)
        with self._lock:
            e, keep = self._prepare(seq_id, token_ids, n_logits)
            return self._forward_one(seq_id, e, token_ids, keep, n_logits)[0]

    @torch.inference_mode()
    def logits_batch(self, calls: list[tuple[int, list[int], int]], hidden: bool = False) -> list:
        """:meth:`logits` for several sequences in one forward pass (continuous batching of decode steps).

        Each sequence keeps its own cache. Sequences with at most ``max_batched_new_tokens`` tokens to compute (decode
        and scoring steps) are run together: their caches are left-padded to a common length and stacked, their new
        tokens left-padded to a common count, and a 4D attention mask keeps every sequence to its own tokens (padding is
        never attended to); the caches are split back afterwards. Longer work (a prefill, a cache miss) runs alone, so
        one prompt does not pad every sequence of the batch to its length, and sequences whose caches differ too much in
        length run in separate forwards (:meth:`_groups`).

        Args:
            calls: (seq_id, token_ids, n_logits) per sequence, as for :meth:`logits`; seq_ids must be distinct.
            hidden: also return the last hidden states of those positions (the decoder's output, after its final norm:
                what the LM head reads).

        Returns:
            per call, [n_logits, V] logits (model dtype) on the model's device; with ``hidden``, (logits, hidden
            [n_logits, H]) pairs.

        Raises:
            ValueError: as :meth:`logits` (checked for every call before any forward), or a repeated seq_id.
        """
        for _, ids, n in calls:
            self.check(ids, n)
        if len({c[0] for c in calls}) != len(calls):
            raise ValueError("logits_batch: every sequence may appear once per batch")
        out: list[tuple[torch.Tensor, torch.Tensor] | None] = [None] * len(calls)
        with self._lock:
            batch = []
            for i, (seq_id, ids, n) in enumerate(calls):
                e, keep = self._prepare(seq_id, ids, n)
                if len(ids) - keep > self.max_batched_new_tokens:
                    out[i] = self._forward_one(seq_id, e, ids, keep, n)
                else:
                    batch.append((i, seq_id, e, ids, keep, n))
            for group in self._groups(batch):
                if len(group) == 1:
                    i, seq_id, e, ids, keep, n = group[0]
                    out[i] = self._forward_one(seq_id, e, ids, keep, n)
                else:
                    for i, result in zip((b[0] for b in group), self._forward_batch(group)):
                        out[i] = result
        done = [o for o in out if o is not None]
        assert len(done) == len(out)  # every call ran, alone or in a group
        return done if hidden else [lg for lg, _ in done]

    def _groups(self, batch: list) -> list[list]:
        """Split a batch where left-padding would cost more than an extra forward.

        Every row of a batched forward is padded to the longest cache in it, so one long sequence among short ones
        would make every row attend over (and copy) its length. Rows are taken by cached length; a row joins the
        current group unless that would leave more than ``max_padded_positions`` padded (row x position) slots in it.
        The default is about one forward's cost in padding (docs/benchmarks.md has the measurement).
        """
        groups: list[list] = []
        total = 0
        for row in sorted(batch, key=lambda b: b[4]):
            c = row[4]
            if groups and (len(groups[-1]) + 1) * c - (total + c) <= self.max_padded_positions:
                groups[-1].append(row)
                total += c
            else:
                groups.append([row])
                total = c
        return groups

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

    def _prepare(self, seq_id: int, token_ids: list[int], n_logits: int) -> tuple[_Entry, int]:
        """The sequence's entry cropped to the reusable prefix, and that prefix's length."""
        e = self._entries.get(seq_id, _Entry)
        limit = len(token_ids) - n_logits
        keep = min(common_prefix_len(e.ids, token_ids), limit)
        # Positions from ``keep`` on are overwritten by the forward (a rollback costs nothing); if it raises, the
        # entry is dropped.
        if len(e.hashes) > keep // self.block_size:
            self._unindex(e, keep // self.block_size)
        e.ids = list(token_ids[:keep])
        if self.prefix_caching and limit - keep >= self.block_size:
            keep = self._reuse_prefix(e, token_ids, keep, limit)
        return e, keep

    def _forward_one(self, seq_id: int, e: _Entry, token_ids: list[int], keep: int,
                     n_logits: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self._forward([(0, seq_id, e, token_ids, keep, n_logits)])[0]

    def _forward_batch(self, batch: list) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """One forward over several sequences (a batched round; see :meth:`_forward`)."""
        return self._forward(batch)

    def _forward(self, batch: list) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """One forward over one or several sequences (see :meth:`logits_batch`); returns their (logits, last hidden
        states) in order.

        Rows are laid out as ``[left padding | the row's cached positions | left padding | its new tokens]`` over
        ``c_max + n_max`` key positions; a 4D attention mask keeps every row to its own tokens, causally, and padding
        queries attend only to themselves. The keys and values come from each sequence's :class:`SlotCache` and the
        new ones are written into it (no per-round stacking and splitting of caches).
        """
        cached = [keep for _, _, _, _, keep, _ in batch]
        new = [ids[keep:] for _, _, _, ids, keep, _ in batch]
        b, c_max, n_max = len(batch), max(cached), max(len(x) for x in new)
        dev = self.device
        ids = torch.zeros((b, n_max), dtype=torch.long)
        pos = torch.zeros((b, n_max), dtype=torch.long)
        # allowed[row, q, col]: query q (column c_max + q) may attend to column col
        allowed = torch.zeros((b, 1, n_max, c_max + n_max), dtype=torch.bool)
        causal = torch.ones((n_max, n_max), dtype=torch.bool).tril()
        for row, (c, toks) in enumerate(zip(cached, new)):
            n = len(toks)
            ids[row, n_max - n :] = torch.tensor(toks, dtype=torch.long)
            pos[row, n_max - n :] = torch.arange(c, c + n)
            allowed[row, 0, n_max - n :, c_max - c : c_max] = True  # its own cache
            allowed[row, 0, n_max - n :, c_max + n_max - n :] = causal[:n, :n]  # its own new tokens, causally
            pad = torch.arange(n_max - n)
            allowed[row, 0, pad, c_max + pad] = True  # padding queries see only themselves (no empty softmax row)
        mask = torch.zeros(allowed.shape, dtype=self.dtype)
        mask.masked_fill_(~allowed, torch.finfo(self.dtype).min)
        rows = [(e.slots, c, len(toks)) for (_, _, e, _, _, _), c, toks in zip(batch, cached, new)]
        n_keep = max(n for *_, n in batch)
        try:
            out = self._decoder(input_ids=ids.to(dev), attention_mask=mask.to(dev), position_ids=pos.to(dev),
                                use_cache=True, **{self._cache_kw: RoundCache(rows, c_max, n_max)})
            hidden = out.last_hidden_state[:, -n_keep:]  # [B, n_keep, H]
            logits = self._head(hidden)
            hidden = self._aux.extend(hidden, n_keep)  # [B, n_keep, H x (1 + aux layers)]
        except Exception:
            for _, seq_id, *_ in batch:
                dropped = self._entries.pop(seq_id)
                if dropped is not None:
                    self._unindex(dropped)
            raise
        results = []
        for row, (_, _, e, token_ids, _, n_logits) in enumerate(batch):
            e.ids = list(token_ids)
            if self.prefix_caching:
                start = len(e.hashes)
                block_hashes(e.ids, self.block_size, start, e.hashes)
                for h in e.hashes[start:]:
                    self._index[h] = e
            results.append((logits[row, n_keep - n_logits :], hidden[row, n_keep - n_logits :]))
        self._enforce_budget({seq_id for _, seq_id, *_ in batch})
        return results
