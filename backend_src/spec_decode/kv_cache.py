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

    Thread safety: calls are serialised by a lock (one forward at a time per model instance).
    """

    def __init__(self, model, max_sequences: int = 64):
        if max_sequences < 1:
            raise ValueError(f"max_sequences must be >= 1, got {max_sequences}")
        self.model = model
        self.max_sequences = max_sequences
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
        if not 1 <= n_logits <= len(token_ids):
            raise ValueError(f"n_logits must be in [1, {len(token_ids)}], got {n_logits}")
        if min(token_ids) < 0 or max(token_ids) >= self.vocab_size:
            raise ValueError(f"token ids must lie in [0, {self.vocab_size}), got {min(token_ids)}..{max(token_ids)}")
        with self._lock:
            e = self._entry(seq_id)
            keep = min(common_prefix_len(e.ids, token_ids), len(token_ids) - n_logits)
            if len(e.ids) > keep:
                e.cache.crop(keep - len(e.ids))  # crop(-n) drops the last n positions
            # Tokens must be kept in step with the cache before the forward: if it raises, drop the entry.
            e.ids = list(token_ids[:keep])
            new = torch.tensor([token_ids[keep:]], dtype=torch.long, device=self.device)
            try:
                out = self.model(input_ids=new, cache=e.cache, use_cache=True, logits_to_keep=n_logits)
            except Exception:
                self._entries.pop(seq_id, None)
                raise
            e.ids = list(token_ids)
            return out.logits[0, -n_logits:]
