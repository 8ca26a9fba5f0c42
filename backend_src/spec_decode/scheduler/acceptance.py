"""What ``speculative_method=auto`` counts and predicts with: acceptance as decayed Bernoulli counts, the expected
tokens of a step from a per-token acceptance rate, and the names of its arms (a method's chains, and its trees of each
width).

The expected tokens are Leviathan et al. 2023 ("Fast Inference from Transformers via Speculative Decoding", eq. 1);
the counts follow SmartSpec's per-request acceptance estimate (Liu et al. 2024, arXiv:2406.14066). Used by
:class:`~.auto.AutoController`.
"""

from __future__ import annotations

from dataclasses import dataclass


def expected_tokens(alpha: float, k: float) -> float:
    """Expected tokens emitted by a step that drafts ``k`` tokens, each accepted with probability ``alpha`` given
    the previous ones were (Leviathan et al. 2023, eq. 1): ``(1 - alpha**(k+1)) / (1 - alpha)``; k + 1 at alpha 1.
    A fractional k (a tree's expected depth, :meth:`AutoController.depth_ratio`) interpolates.

    Raises:
        ValueError: alpha outside [0, 1] or k < 0.
    """
    if not 0.0 <= alpha <= 1.0 or k < 0:
        raise ValueError(f"alpha must be in [0, 1] and k >= 0, got {alpha}, {k}")
    if alpha >= 1.0:
        return float(k + 1)
    return (1.0 - alpha ** (k + 1)) / (1.0 - alpha)


def step_trials(drafted: int, accepted: int) -> tuple[int, int]:
    """(successes, trials) of one verified step for a per-token acceptance estimate: the drafts are tried in order
    until the first rejection, so ``accepted`` successes and one failure unless every draft was accepted.

    Raises:
        ValueError: accepted outside [0, drafted].
    """
    if not 0 <= accepted <= drafted:
        raise ValueError(f"accepted must be in [0, drafted={drafted}], got {accepted}")
    return accepted, accepted + (1 if accepted < drafted else 0)


@dataclass
class AcceptanceStats:
    """Decayed per-token acceptance counts (successes, trials) of one proposer for one sequence or for the server.

    Every :meth:`decay` multiplies both counts by a factor, so recent steps weigh most.
    """

    successes: float = 0.0
    trials: float = 0.0

    def add(self, successes: int, trials: int) -> None:
        """Count one step's (successes, trials) (:func:`step_trials`)."""
        self.successes += successes
        self.trials += trials

    def decay(self, factor: float) -> None:
        """Multiply both counts by ``factor`` (in (0, 1])."""
        self.successes *= factor
        self.trials *= factor

    def mean(self) -> float:
        """The Laplace estimate (successes + 1) / (trials + 2): 1/2 with no evidence."""
        return (self.successes + 1.0) / (self.trials + 2.0)


TREE_ARM = "+tree"
"""Suffix of the name under which the controller counts a method's tree steps (``eagle3+tree``): a method that drafts
trees is two arms or more, its chains and its trees (of each width it may choose), each with its own acceptance per
depth."""


def arm(method: str, tree: bool, top_k: int = 0) -> str:
    """The controller's name for ``method`` drafting chains (``method``) or trees (``method`` + :data:`TREE_ARM`, then
    the trees' width where auto chose one: ``eagle3+tree4``; ``top_k`` 0: the config's width, or a proposer whose trees
    have none)."""
    if not tree:
        return method
    return method + TREE_ARM + (str(top_k) if top_k else "")


__all__ = ["TREE_ARM", "AcceptanceStats", "arm", "expected_tokens", "step_trials"]
