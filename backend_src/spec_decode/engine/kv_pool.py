"""The device side of the paged KV pool: every layer's keys and values in fixed pages, and the cache object through
which a transformers decoder writes and reads them in one round (vLLM's paged KV cache, ``vllm/v1/worker/
gpu_model_runner.py``'s slot mapping; the block manager is :mod:`.pages`).

Layout: per layer, keys and values ``[kv_heads, num_pages x page_size, head_dim]`` (head-major: a run of slots is a
view in the layout the attention reads, contiguous per head); position p of a sequence whose page list is ``pages`` is
slot ``pages[p // page_size] x page_size + p % page_size``. A round's new keys and values go to
their slots with one ``index_copy_`` per layer (``write_slots``: padded rows and padded query columns write into the
trash page, slot 0); the attention reads each row's slots ``0 .. L - 1`` gathered through its block table, positions
past the row's length redirected to slot 0, so nothing reads a slot no forward wrote and masked keys are finite (a
masked weight is 0, and 0 x NaN would still be NaN). Every shape is the round's padded shape: no host synchronisation,
so the forward can be captured in a CUDA graph (:mod:`.cuda_graphs`). How many positions a pool holds:
:func:`pool_tokens`.
"""

from __future__ import annotations

import inspect
import os

import torch

from ..settings import LMSettings
from .pages import TRASH_PAGE


def cache_keyword(model) -> str:
    """The keyword by which ``model.forward`` takes its KV cache: ``cache`` in the transformers that
    requirements.txt pins (where ``past_key_values`` is deprecated), ``past_key_values`` in earlier 5.x releases such as
    5.17 (which would pass an unknown ``cache`` on to the attention and ignore it)."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def kv_shape(config) -> tuple[int, int, int]:
    """(layers, KV heads, head dim) of a transformers decoder config (``num_key_value_heads`` defaults to the
    attention heads, ``head_dim`` to hidden / heads)."""
    heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return int(config.num_hidden_layers), int(heads), int(head_dim)


CPU_AUTO_FRACTION = 0.25  # max_tokens = 0 on a CPU: a quarter of the machine's memory (mapped as it is written)


def pool_tokens(max_tokens: int, bytes_per_token: int, device: torch.device, gpu_memory_utilization: float) -> int:
    """Positions the KV pool holds.

    On CUDA: ``max_tokens``, refused when it does not fit in ``gpu_memory_utilization`` of the device's memory less
    what is in use now (the weights, other processes); ``max_tokens`` = 0: as many as fit there (vLLM's
    ``gpu_memory_utilization``). On a CPU: ``max_tokens``, or 0: :data:`CPU_AUTO_FRACTION` of the machine's memory.

    Raises:
        ValueError: naming ``kv_cache_max_tokens`` and ``gpu_memory_utilization`` when the pool does not fit.
    """
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        room = int(total * gpu_memory_utilization) - (total - free)
        fit = max(0, room // bytes_per_token)
        if max_tokens and max_tokens > fit or not max_tokens and fit < LMSettings.MIN_KV_CACHE_TOKENS:
            raise ValueError(f"kv_cache_max_tokens={max_tokens} ({bytes_per_token} bytes a token) does not fit in "
                             f"gpu_memory_utilization={gpu_memory_utilization} of the GPU's {total / 2**30:.1f} GiB "
                             f"({(total - free) / 2**30:.1f} GiB in use): at most {fit} tokens")
        return max_tokens or fit
    if max_tokens:
        return max_tokens
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return max(LMSettings.MIN_KV_CACHE_TOKENS, int(memory * CPU_AUTO_FRACTION) // bytes_per_token)


def read_slots(block_table: torch.Tensor, lengths: torch.Tensor, page_size: int,
               positions: int | None = None) -> torch.Tensor:
    """[R, L] int64: the slots of each row's key positions 0 .. L-1 through its block table ``block_table`` [R, P]
    (L = ``positions``, default P x ``page_size``); positions at or past the row's length (``lengths`` [R]) read slot
    0, the trash page's (written, finite: the attention's mask drops them). Shapes depend only on the inputs' shapes
    (no host synchronisation)."""
    cols = torch.arange(positions or block_table.shape[1] * page_size, device=block_table.device)
    slots = block_table[:, cols // page_size] * page_size + cols % page_size
    return torch.where(cols[None] < lengths[:, None], slots, TRASH_PAGE * page_size)


class KVPool:
    """Keys and values of every layer in ``num_pages`` pages of ``page_size`` slots.

    One tensor ``[layers, 2, kv_heads, num_pages x page_size, head_dim]`` allocated uninitialised (on a CPU a large
    allocation is mapped lazily: memory is taken as pages are first written), the trash page zeroed.

    Args:
        layers, kv_heads, head_dim: the model's attention shape (:func:`kv_shape`).
        num_pages: pages, the trash page included (>= 2).
        page_size: slots per page.
        dtype, device: of the keys and values (the model's).
    """

    def __init__(self, layers: int, kv_heads: int, head_dim: int, num_pages: int, page_size: int,
                 dtype: torch.dtype, device: torch.device):
        self.layers, self.kv_heads, self.head_dim = layers, kv_heads, head_dim
        self.num_pages, self.page_size = num_pages, page_size
        self.data = torch.empty((layers, 2, kv_heads, num_pages * page_size, head_dim), dtype=dtype, device=device)
        self.data[:, :, :, TRASH_PAGE * page_size : (TRASH_PAGE + 1) * page_size] = 0
        self.keys = [self.data[i, 0] for i in range(layers)]  # per layer [kv_heads, slots, head_dim] views
        self.values = [self.data[i, 1] for i in range(layers)]

    @property
    def nbytes(self) -> int:
        """Bytes the pool reserves."""
        return self.data.numel() * self.data.element_size()

    def copy_prefix(self, src: int, dst: int, n: int) -> None:
        """Copy the first ``n`` slots of page ``src`` into page ``dst``, every layer (copy-on-write of a shared
        page)."""
        ps = self.page_size
        self.data[:, :, :, dst * ps : dst * ps + n] = self.data[:, :, :, src * ps : src * ps + n]

    def copy_slots(self, src: list[int], dst: list[int]) -> None:
        """Copy slots ``src`` into slots ``dst`` (same length), every layer; every source is read before any slot is
        written (a draft tree's accepted path moved into place, :mod:`.tree_slots`)."""
        if src:
            index = torch.tensor([src, dst], dtype=torch.int64)
            if self.data.device.type == "cuda":  # no host synchronisation: a pinned copy, in stream order
                index = index.pin_memory().to(self.data.device, non_blocking=True)
            self.data[:, :, :, index[1]] = self.data[:, :, :, index[0]]

    def slots(self) -> int:
        """Slots per layer (pages x page size)."""
        return self.data.shape[3]

    @staticmethod
    def write(store: torch.Tensor, slots: torch.Tensor, x: torch.Tensor) -> None:
        """Write ``x`` [kv_heads, n, D] into slots ``slots`` [n] of ``store`` (a layer's keys or values)."""
        store.index_copy_(1, slots, x.to(store.dtype))

    @staticmethod
    def gather(store: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        """Rows of slots ``slots`` [R, L] of ``store``: [R, kv_heads, L, D]."""
        r, length = slots.shape
        return store.index_select(1, slots.reshape(-1)).view(store.shape[0], r, length, -1).transpose(0, 1)


class PagedCache:
    """The cache object one round hands a transformers decoder: implements ``update(keys, values, layer_idx)``, the
    method its attention layers call.

    The new keys and values ``[B, kv_heads, Q, D]`` are written to ``write_slots`` ``[B x Q]``; the attention gets
    ``[B, kv_heads, L, D]`` gathered from ``read_slots`` ``[B, L]`` (the layout the round's 4D mask describes).

    Args:
        pool: the pool.
        write_slots: [B x Q] int64 slot of each query position (padded ones: the trash page).
        read_slots: [B, L] int64 slot of each key position of each row (past the row's length: slot 0); or None
            with ``span``.
        span: (first slot, L, n) for one row whose slots are consecutive (an eager round of one sequence whose pages
            follow each other) and whose first n query columns are its new tokens (the rest padding, which writes
            nothing): its new keys and values are written as a slice and the attention reads a view of the pool, no
            scatter and no gather.
    """

    def __init__(self, pool: KVPool, write_slots: torch.Tensor, read_slots: torch.Tensor | None,
                 span: tuple[int, int, int] | None = None):
        self.pool, self.write_slots, self.read_slots, self.span = pool, write_slots, read_slots, span

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        """Store the new keys and values; return the keys and values the attention runs over (class docstring)."""
        b, h, q, d = key_states.shape
        stores = (self.pool.keys[layer_idx], self.pool.values[layer_idx])
        if self.span is not None:
            start, length, n = self.span
            end = start + length
            out = []
            for store, x in zip(stores, (key_states, value_states)):
                store[:, end - n : end] = x[0, :, :n]
                out.append(store[None, :, start:end])
            return out[0], out[1]
        assert self.read_slots is not None
        out = []
        for store, x in zip(stores, (key_states, value_states)):
            KVPool.write(store, self.write_slots, x.transpose(0, 1).reshape(h, b * q, d))
            out.append(KVPool.gather(store, self.read_slots))
        return out[0], out[1]


__all__ = ["CPU_AUTO_FRACTION", "KVPool", "PagedCache", "cache_keyword", "kv_shape", "pool_tokens", "read_slots"]
