"""One sequence's context in the EAGLE head: the keys and values of its pairs, cut back on a rollback."""

from __future__ import annotations

import torch


class EagleContext:
    """One sequence's pairs in the head: their keys and values ``[kv_heads, capacity, D]`` (pair ``start + i`` at
    index i; the first ``length`` hold), built from the committed ids ``ids`` (pair j read x_{j+1})."""

    GROW = 256  # pairs allocated beyond the need when a buffer grows

    def __init__(self) -> None:
        self.ids: list[int] = []
        self.start = 0
        self.length = 0
        self.keys: torch.Tensor | None = None
        self.values: torch.Tensor | None = None

    def write(self, at: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Store keys/values [kv_heads, n, D] at indices ``at .. at + n - 1`` (growing the buffers)."""
        end = at + keys.shape[1]
        if self.keys is None or self.keys.shape[1] < end:
            grown = [x.new_empty((x.shape[0], end + self.GROW, x.shape[2])) for x in (keys, values)]
            if self.keys is not None and at:
                assert self.values is not None  # keys and values are allocated together
                grown[0][:, :at], grown[1][:, :at] = self.keys[:, :at], self.values[:, :at]
            self.keys, self.values = grown
        assert self.keys is not None and self.values is not None
        self.keys[:, at:end], self.values[:, at:end] = keys, values
