"""The KV buffers of :class:`~.kv_cache.CachedCausalLM`: one sequence's keys and values written in place
(:class:`SlotCache`), the cache object one batched forward hands the model (:class:`RoundCache`), and the keyword
by which the model takes it (:func:`cache_keyword`)."""

from __future__ import annotations

import torch


def cache_keyword(model) -> str:
    """The keyword by which ``model.forward`` takes its KV cache: ``cache`` in the transformers that
    requirements.txt pins (where ``past_key_values`` is deprecated), ``past_key_values`` in earlier 5.x releases such as
    5.17 (which would pass an unknown ``cache`` on to the attention and ignore it)."""
    import inspect

    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


class SlotCache:
    """One sequence's keys and values, per layer ``[heads, capacity, head_dim]`` buffers written in place.

    Positions ``[0, len(entry.ids))`` hold the sequence's cached tokens; a rollback is just a shorter ``ids`` (the
    positions after it are overwritten by the next forward). Buffers are allocated at the first write of each layer,
    from the shapes the model produces, and grow by at least 256 positions (amortised copies).
    """

    GROW = 256

    def __init__(self) -> None:
        self.keys: list[torch.Tensor | None] = []
        self.values: list[torch.Tensor | None] = []

    @property
    def capacity(self) -> int:
        """Positions allocated (per layer; 0 before the first write)."""
        return 0 if not self.keys or self.keys[0] is None else int(self.keys[0].shape[1])

    def copy_from(self, src: SlotCache, start: int, end: int) -> None:
        """Copy positions ``start .. end - 1`` of every layer from ``src`` (prefix caching: the same token ids)."""
        for layer, (k, v) in enumerate(zip(src.keys, src.values)):
            assert k is not None and v is not None  # src holds at least ``end`` positions of every layer
            self.write(layer, start, k[:, start:end], v[:, start:end])

    def write(self, layer: int, start: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Store ``keys``/``values`` ([heads, n, head_dim]) at positions ``start .. start + n - 1`` of ``layer``."""
        while len(self.keys) <= layer:
            self.keys.append(None)
            self.values.append(None)
        end = start + keys.shape[1]
        for store, x in ((self.keys, keys), (self.values, values)):
            buf = store[layer]
            if buf is None or buf.shape[1] < end:
                grown = x.new_empty((x.shape[0], max(end, 0 if buf is None else buf.shape[1]) + self.GROW,
                                     x.shape[2]))
                if buf is not None and start:
                    grown[:, :start] = buf[:, :start]
                store[layer] = buf = grown
            buf[:, start:end] = x


class RoundCache:
    """The cache object one forward of :meth:`~.kv_cache.CachedCausalLM._forward` hands the model.

    Implements the one method transformers' attention layers call, ``update(keys, values, layer_idx)``: the new keys
    and values ([B, heads, n_max, head_dim], rows left-padded) are written into each sequence's :class:`SlotCache`, and
    the attention gets ``[B, heads, c_max + n_max, head_dim]`` in the layout of the forward's 4D mask. With one
    sequence that is a view of its buffers (no copy); with several, one gather per layer, padding zeroed (a masked
    position gets weight 0, and 0 x an uninitialised NaN would still be NaN).

    Args:
        rows: per sequence, (its slot cache, cached positions c, new tokens n).
        c_max, n_max: the largest c and n of the forward.
    """

    def __init__(self, rows: list[tuple[SlotCache, int, int]], c_max: int, n_max: int):
        self.rows, self.c_max, self.n_max = rows, c_max, n_max

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        """Store the new keys/values; return the keys/values the attention runs over (see the class docstring)."""
        c_max, n_max = self.c_max, self.n_max
        for row, (slots, c, n) in enumerate(self.rows):
            slots.write(layer_idx, c, key_states[row, :, n_max - n :], value_states[row, :, n_max - n :])
        if len(self.rows) == 1:
            slots, c, n = self.rows[0]
            keys, values = slots.keys[layer_idx], slots.values[layer_idx]
            assert keys is not None and values is not None  # written just above
            return keys[None, :, : c + n], values[None, :, : c + n]
        out = []
        for kind, x in (("keys", key_states), ("values", value_states)):
            full = x.new_empty((x.shape[0], x.shape[1], c_max + n_max, x.shape[3]))
            for row, (slots, c, _) in enumerate(self.rows):
                buf = getattr(slots, kind)[layer_idx]
                if c < c_max:
                    full[row, :, : c_max - c] = 0
                full[row, :, c_max - c : c_max] = buf[:, :c]
            full[:, :, c_max:] = x
            out.append(full)
        return out[0], out[1]
