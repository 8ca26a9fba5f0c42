"""A causal LM with per-sequence KV caches that reuse the longest cached prefix.

Used by the target scorer and the draft LM proposer. Each call names a sequence and the full token list whose last
``n_logits`` positions' logits it needs. The cache of that sequence is cropped to the longest common prefix of what it
holds and the new tokens (rollback after a rejection is just this crop) and only the rest is computed. A cache miss
costs time, never correctness. Entries are bounded by count (LRU) and freed by :meth:`CachedCausalLM.release`.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass, field

import torch


def common_prefix_len(a: list[int], b: list[int]) -> int:
    """Length of the longest common prefix of two token lists."""
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


@dataclass
class _Entry:
    ids: list[int] = field(default_factory=list)  # tokens whose keys/values are in ``cache``
    cache: object = None  # transformers DynamicCache


class CachedCausalLM:
    """Wraps a Hugging Face causal LM with an LRU of per-sequence ``DynamicCache`` objects.

    Args:
        model: a transformers ``*ForCausalLM`` in eval mode.
        max_sequences: most sequences cached at once; the least recently used is evicted beyond it (>= 1).
        max_batched_new_tokens: in :meth:`logits_batch`, sequences with more new tokens than this run alone.
        max_padded_positions: in :meth:`logits_batch`, sequences are split into separate forwards where left-padding
            their caches to a common length would leave more padded (row x position) slots than this.

    Thread safety: calls are serialised by a lock (one forward at a time per model instance).
    """

    def __init__(self, model, max_sequences: int = 64, max_batched_new_tokens: int = 16,
                 max_padded_positions: int = 2048):
        if max_sequences < 1:
            raise ValueError(f"max_sequences must be >= 1, got {max_sequences}")
        self.model = model
        self.max_sequences = max_sequences
        self.max_batched_new_tokens = max_batched_new_tokens
        self.max_padded_positions = max_padded_positions
        self.device = next(model.parameters()).device
        self.vocab_size = int(model.config.vocab_size)
        self._entries: OrderedDict[int, _Entry] = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._entries)

    def cached_tokens(self) -> int:
        """Tokens held in all the sequences' caches (their keys and values take memory in proportion)."""
        with self._lock:
            return sum(len(e.ids) for e in self._entries.values())

    def cached_ids(self, seq_id: int) -> list[int] | None:
        """Tokens currently held in the cache of ``seq_id`` (None when absent)."""
        e = self._entries.get(seq_id)
        return None if e is None else list(e.ids)

    def release(self, seq_id: int) -> bool:
        """Free the cache of ``seq_id``; returns whether there was one."""
        with self._lock:
            return self._entries.pop(seq_id, None) is not None

    def clear(self) -> None:
        """Free every cached sequence."""
        with self._lock:
            self._entries.clear()

    def _entry(self, seq_id: int) -> _Entry:
        e = self._entries.get(seq_id)
        if e is None:
            from transformers import DynamicCache

            e = _Entry(cache=DynamicCache(config=self.model.config))
            self._entries[seq_id] = e
            while len(self._entries) > self.max_sequences:
                self._entries.popitem(last=False)
        else:
            self._entries.move_to_end(seq_id)
        return e

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
            ValueError: ``n_logits`` outside [1, L], or a token id outside [0, V).
        """
        self.check(token_ids, n_logits)
        with self._lock:
            e, keep = self._prepare(seq_id, token_ids, n_logits)
            return self._forward_one(seq_id, e, token_ids, keep, n_logits)

    @torch.inference_mode()
    def logits_batch(self, calls: list[tuple[int, list[int], int]]) -> list[torch.Tensor]:
        """:meth:`logits` for several sequences in one forward pass (continuous batching of decode steps).

        Each sequence keeps its own cache. Sequences with at most ``max_batched_new_tokens`` tokens to compute (decode and
        scoring steps) are run together: their caches are left-padded to a common length and stacked, their new tokens
        left-padded to a common count, and a 4D attention mask keeps every sequence to its own tokens (padding is never
        attended to); the caches are split back afterwards. Longer work (a prefill, a cache miss) runs alone, so one
        prompt does not pad every sequence of the batch to its length, and sequences whose caches differ too much in
        length run in separate forwards (:meth:`_groups`).

        Args:
            calls: (seq_id, token_ids, n_logits) per sequence, as for :meth:`logits`; seq_ids must be distinct.

        Returns:
            per call, [n_logits, V] logits (model dtype) on the model's device.

        Raises:
            ValueError: as :meth:`logits` (checked for every call before any forward), or a repeated seq_id.
        """
        for _, ids, n in calls:
            self.check(ids, n)
        if len({c[0] for c in calls}) != len(calls):
            raise ValueError("logits_batch: every sequence may appear once per batch")
        out: list[torch.Tensor | None] = [None] * len(calls)
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
                    for i, logits in zip((b[0] for b in group), self._forward_batch(group)):
                        out[i] = logits
        return out

    def _groups(self, batch: list) -> list[list]:
        """Split a batch where left-padding would cost more than an extra forward.

        Every row of a batched forward is padded to the longest cache in it: one 2,000-token sequence among short ones
        would make every row attend over (and the stacking copy) 2,000 positions. Rows are taken by cached length; a
        row joins the current group unless that would leave more than ``max_padded_positions`` padded (row x
        position) slots in it. (On the 2-core CPU a padded slot costs an estimated ~37 us of copies and attention,
        and streaming a forward's weights ~70 ms: 2,048 slots is about one forward.)
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
        """Raise ValueError (naming the bound) unless :meth:`logits` accepts ``token_ids`` and ``n_logits``."""
        if not 1 <= n_logits <= len(token_ids):
            raise ValueError(f"n_logits must be in [1, {len(token_ids)}], got {n_logits}")
        if min(token_ids) < 0 or max(token_ids) >= self.vocab_size:
            raise ValueError(f"token ids must lie in [0, {self.vocab_size}), got {min(token_ids)}..{max(token_ids)}")

    def _prepare(self, seq_id: int, token_ids: list[int], n_logits: int) -> tuple[_Entry, int]:
        """The sequence's entry cropped to the reusable prefix, and that prefix's length."""
        e = self._entry(seq_id)
        keep = min(common_prefix_len(e.ids, token_ids), len(token_ids) - n_logits)
        if len(e.ids) > keep:
            e.cache.crop(keep - len(e.ids))  # crop(-n) drops the last n positions
        # Tokens must be kept in step with the cache before the forward: if it raises, the entry is dropped.
        e.ids = list(token_ids[:keep])
        return e, keep

    def _forward_one(self, seq_id: int, e: _Entry, token_ids: list[int], keep: int, n_logits: int) -> torch.Tensor:
        new = torch.tensor([token_ids[keep:]], dtype=torch.long, device=self.device)
        try:
            out = self.model(input_ids=new, cache=e.cache, use_cache=True, logits_to_keep=n_logits)
        except Exception:
            self._entries.pop(seq_id, None)
            raise
        e.ids = list(token_ids)
        return out.logits[0, -n_logits:]

    def _forward_batch(self, batch: list) -> list[torch.Tensor]:
        """One forward over several sequences (see :meth:`logits_batch`); returns their logits in order."""
        from transformers import DynamicCache

        cfg = self.model.config
        cached = [keep for _, _, _, _, keep, _ in batch]
        new = [ids[keep:] for _, _, _, ids, keep, _ in batch]
        b, c_max, n_max = len(batch), max(cached), max(len(x) for x in new)
        layers = cfg.num_hidden_layers
        dtype = next(self.model.parameters()).dtype
        heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        stacked = DynamicCache(config=cfg)
        if c_max > 0:
            for layer in range(layers):
                k = torch.zeros((b, heads, c_max, head_dim), dtype=dtype, device=self.device)
                v = torch.zeros_like(k)
                for row, (_, _, e, _, c, _) in enumerate(batch):
                    if c:
                        k[row, :, c_max - c :] = e.cache.layers[layer].keys[0]
                        v[row, :, c_max - c :] = e.cache.layers[layer].values[0]
                stacked.update(k, v, layer)
        ids = torch.zeros((b, n_max), dtype=torch.long, device=self.device)
        pos = torch.zeros((b, n_max), dtype=torch.long, device=self.device)
        # allowed[row, q, col]: query q (column c_max + q) may attend to column col
        allowed = torch.zeros((b, 1, n_max, c_max + n_max), dtype=torch.bool, device=self.device)
        causal = torch.ones((n_max, n_max), dtype=torch.bool, device=self.device).tril()
        for row, (c, toks) in enumerate(zip(cached, new)):
            n = len(toks)
            ids[row, n_max - n :] = torch.tensor(toks, dtype=torch.long, device=self.device)
            pos[row, n_max - n :] = torch.arange(c, c + n, device=self.device)
            allowed[row, 0, n_max - n :, c_max - c : c_max] = True  # its own cache
            allowed[row, 0, n_max - n :, c_max + n_max - n :] = causal[:n, :n]  # its own new tokens, causally
            pad = torch.arange(n_max - n, device=self.device)
            allowed[row, 0, pad, c_max + pad] = True  # padding queries see only themselves (no empty softmax row)
        mask = torch.zeros(allowed.shape, dtype=dtype, device=self.device)
        mask.masked_fill_(~allowed, torch.finfo(dtype).min)
        n_keep = max(n for *_, n in batch)
        try:
            out = self.model(input_ids=ids, attention_mask=mask, position_ids=pos, cache=stacked, use_cache=True,
                             logits_to_keep=n_keep)
        except Exception:
            for _, seq_id, *_ in batch:
                self._entries.pop(seq_id, None)
            raise
        results = []
        for row, (_, _, e, token_ids, c, n_logits) in enumerate(batch):
            n = len(new[row])
            split = DynamicCache(config=cfg)
            for layer in range(layers):
                k, v = stacked.layers[layer].keys[row : row + 1], stacked.layers[layer].values[row : row + 1]
                split.update(torch.cat([k[:, :, c_max - c : c_max], k[:, :, c_max + n_max - n :]], dim=2),
                             torch.cat([v[:, :, c_max - c : c_max], v[:, :, c_max + n_max - n :]], dim=2), layer)
            e.cache, e.ids = split, list(token_ids)
            results.append(out.logits[row, n_keep - n_logits :])
        return results
