"""Per-sequence state shared by the engine, the proposers and the processors: :class:`SequenceLRU` (every
per-sequence cache here: KV caches, EAGLE contexts, suffix trees, grammar matchers, least recently used first out) and
:func:`common_prefix_len` (how much of a cached sequence a new call's token ids keep). Depends on nothing in the
package, so every subpackage may import it.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from types import MethodType
from typing import Generic, TypeVar
from weakref import WeakMethod

V = TypeVar("V")


class SequenceLRU(Generic[V]):
    """Values keyed by sequence id (uint64), at most ``capacity`` of them; the least recently used leaves first.

    A cache miss must cost time, never correctness (the step protocol carries what a miss needs), so eviction is
    always safe; ``on_evict`` frees what a value holds outside Python (suffix decoding's native trees).

    Args:
        capacity: most values kept (>= 1).
        on_evict: called with (seq_id, value) for each value evicted by the bound (not for :meth:`pop`); a bound
            method is held by a weak reference (the owner of the LRU may pass its own method and still be freed by
            ``del`` alone: no reference cycle), other callables strongly.

    Raises:
        ValueError: ``capacity`` < 1.
    """

    def __init__(self, capacity: int, on_evict: Callable[[int, V], None] | None = None):
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self.capacity = capacity
        # a bound method is held weakly: an owner whose own method this is would otherwise be a reference cycle,
        # freed only by the garbage collector (on CUDA, its pool and graphs would outlive ``del``)
        self._on_evict: Callable[[], Callable[[int, V], None] | None] | None = None
        if isinstance(on_evict, MethodType):
            self._on_evict = WeakMethod(on_evict)
        elif on_evict is not None:
            self._on_evict = lambda: on_evict
        self._items: OrderedDict[int, V] = OrderedDict()

    def __len__(self) -> int:
        return len(self._items)

    def __contains__(self, seq_id: object) -> bool:
        return seq_id in self._items

    def __iter__(self) -> Iterator[int]:
        return iter(self._items)

    def __getitem__(self, seq_id: int) -> V:
        """The value of ``seq_id`` without marking it used.

        Raises:
            KeyError: no value for ``seq_id``.
        """
        return self._items[seq_id]

    def values(self) -> Iterator[V]:
        """The values, least recently used first."""
        return iter(self._items.values())

    def peek(self, seq_id: int) -> V | None:
        """The value of ``seq_id`` without marking it used (None when absent)."""
        return self._items.get(seq_id)

    def get(self, seq_id: int, make: Callable[[], V]) -> V:
        """The value of ``seq_id``, marked most recently used; absent: ``make()``, stored (evicting past the bound)."""
        value = self._items.get(seq_id)
        if value is None:
            return self.put(seq_id, make())
        self._items.move_to_end(seq_id)
        return value

    def put(self, seq_id: int, value: V) -> V:
        """Store ``value`` as the most recently used, evicting the least recently used past ``capacity``; returns it."""
        self._items[seq_id] = value
        self._items.move_to_end(seq_id)
        while len(self._items) > self.capacity:
            old_id, old = self._items.popitem(last=False)
            callback = self._on_evict() if self._on_evict is not None else None
            if callback is not None:
                callback(old_id, old)
        return value

    def pop(self, seq_id: int) -> V | None:
        """Remove and return the value of ``seq_id`` (None when absent); ``on_evict`` is not called."""
        return self._items.pop(seq_id, None)


def common_prefix_len(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the longest common prefix of two token lists."""
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i
