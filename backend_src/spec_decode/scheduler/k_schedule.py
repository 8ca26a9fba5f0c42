"""How many tokens a sequence's next step drafts (k): per-proposer k schedules and vLLM's disable policy.

A schedule is stateless: ``update(k, num_drafted, num_accepted)`` returns the next step's k, and the sequence keeps k
(:class:`~spec_decode.generation.Generation`). The schedule depends only on the request's own steps, so a seeded
request's output stays a function of the request.
"""

from __future__ import annotations

from typing import Protocol

K_SCHEDULES = ("constant", "heuristic")  # generate's num_draft_tokens_schedule: make_schedule's names


class KSchedule(Protocol):
    """k from step to step (transformers' ``num_assistant_tokens_schedule``)."""

    def update(self, k: int, num_drafted: int, num_accepted: int) -> int:  # pragma: no cover - protocol
        """The next step's k after a step that asked for ``k``, got ``num_drafted`` drafts and accepted
        ``num_accepted`` of them (before any stop trimmed them)."""


class ConstantK:
    """k stays the request's ``num_draft_tokens`` (transformers' ``"constant"``)."""

    def update(self, k: int, num_drafted: int, num_accepted: int) -> int:
        """Returns ``k`` unchanged."""
        return k


class HeuristicK:
    """transformers' ``"heuristic"`` schedule: k += 2 (up to ``max_k``) after a step whose drafts were all accepted,
    k -= 1 (down to 1) after a step that rejected one. A step whose proposer found fewer than k tokens leaves k as it
    is (it says nothing about how far the target would follow).

    Args:
        max_k: the largest k (>= 1).

    Raises:
        ValueError: ``max_k`` < 1.
    """

    def __init__(self, max_k: int):
        if max_k < 1:
            raise ValueError(f"max_k must be >= 1, got {max_k}")
        self.max_k = max_k

    def update(self, k: int, num_drafted: int, num_accepted: int) -> int:
        """The next k (see the class docstring)."""
        if k <= 0 or num_drafted < k:
            return k
        return min(k + 2, self.max_k) if num_accepted >= num_drafted else max(1, k - 1)


def make_schedule(name: str, max_k: int) -> KSchedule:
    """The schedule named ``name`` ("constant" or "heuristic", bounded by ``max_k``).

    Raises:
        ValueError: an unknown name.
    """
    if name == "constant":
        return ConstantK()
    if name == "heuristic":
        return HeuristicK(max_k)
    raise ValueError(f"num_draft_tokens_schedule={name!r}: allowed values are {', '.join(K_SCHEDULES)}")


def speculation_disabled(running: int, disable_by_batch_size: int) -> bool:
    """vLLM's ``disable_by_batch_size``: whether ``running`` sequences reach it, so steps run with k = 0 (<= 0: never).

    Speculation spends compute to cut latency, which stops paying at high load.
    """
    return 0 < disable_by_batch_size <= running
