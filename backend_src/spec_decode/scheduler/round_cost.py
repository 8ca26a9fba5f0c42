"""The seconds a round costs, as a function of its sequences and the positions it scores, learned from the rounds.

``speculative_method=auto`` (:mod:`.auto`) weighs expected tokens against these seconds. Every round's result says
how long the target's forward took (``target_forward_seconds`` on the wire, :class:`~spec_decode.protocol.StepResult`),
so the model keeps the forward apart from the rest of the round (generate, the ensemble's hops, the verifier) and from
what drafting adds: nothing is calibrated at load and nothing passes between processes but the step's own tensors
(docs/auto.md).
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Collection

DRAFT_HOP = "draft_model"  # the cost of a round going through draft_model at all (RoundCost.extra's key)


class RoundCost:
    """Predicted seconds of a round of S sequences scoring P positions: ``forward(S, P) + rest(S) + extras``.

    - ``forward(S, P)``: the target's forward, from the forward seconds the rounds report, kept per (S, P) as
      exponential moving averages. Between two measured P of the same S: their linear interpolation; elsewhere the
      nearest measured point moved along the marginal seconds of one more position at that point's S (``slope[S]``:
      the least-squares slope over that S's measured points, since a full round's positions cost more than a lone
      sequence's; with one point, proportional to P, the cautious guess: a position costs its share). With
      ``prior`` (positions -> seconds of one sequence; tests, or a deployer who has the curve) its shape replaces the
      slope, and before any round is measured the prior itself.
    - ``rest(S)``: the round's seconds beyond the forward in rounds without drafts (nearest measured S).
    - extras: what the draft_model hop (:data:`DRAFT_HOP`) and each model proposer (the draft LM, a head) add to a
      round they take part in, learned as the measured time above ``forward + rest``, split evenly.

    Before anything is measured (and without a prior) the forward is taken as P units: only ratios matter then, and
    a round with drafts looks as dear as the positions it scores, so speculation starts from probes.

    Args:
        weight: the moving averages' weight of a new measurement, in (0, 1].
        prior: positions -> seconds of one sequence's forward, or None.

    Raises:
        ValueError: weight outside (0, 1], or a prior with a position < 1 or a time <= 0.
    """

    def __init__(self, weight: float = 0.2, prior: dict[int, float] | None = None):
        if not 0.0 < weight <= 1.0:
            raise ValueError(f"weight must be in (0, 1], got {weight}")
        self.weight = weight
        self.forward: dict[tuple[int, int], float] = {}  # (sequences, positions) -> forward seconds
        self.rest: dict[int, float] = {}  # sequences -> seconds of a round beyond its forward (no drafts)
        self.extra: dict[str, float] = {}  # model proposer or the draft_model hop -> seconds it adds to a round
        self.slope: dict[int, float] = {}  # sequences -> seconds of one more position in their forward
        items = sorted((int(p), float(s)) for p, s in (prior or {}).items())
        if any(p < 1 or s <= 0 for p, s in items):
            raise ValueError(f"a prior needs positions >= 1 and times > 0, got {prior}")
        self._prior_p = [p for p, _ in items]
        self._prior_s = [s for _, s in items]

    def _ema(self, old: float | None, new: float) -> float:
        return new if old is None else (1 - self.weight) * old + self.weight * new

    def _prior(self, positions: float) -> float:
        """The prior curve at ``positions``: linear between its points, extended with its last slope (never
        decreasing) past the largest and flat below the smallest."""
        ps, ss = self._prior_p, self._prior_s
        if positions <= ps[0]:
            return ss[0]
        i = bisect_left(ps, positions)
        if i < len(ps):
            if ps[i] == positions:
                return ss[i]
            p0, p1, s0, s1 = ps[i - 1], ps[i], ss[i - 1], ss[i]
        elif len(ps) >= 2:
            p0, p1, s0, s1 = ps[-2], ps[-1], ss[-2], ss[-1]
        else:
            return ss[0]
        return s0 + max(0.0, (s1 - s0) / (p1 - p0)) * (positions - p0)

    def forward_seconds(self, sequences: int, positions: float) -> float:
        """The predicted forward of ``sequences`` scoring ``positions`` (see the class docstring)."""
        if positions == int(positions) and (sequences, int(positions)) in self.forward:
            return self.forward[(sequences, int(positions))]
        same = sorted(p for s, p in self.forward if s == sequences)
        below = [p for p in same if p < positions]
        above = [p for p in same if p > positions]
        if below and above:
            p0, p1 = below[-1], above[0]
            t0, t1 = self.forward[(sequences, p0)], self.forward[(sequences, p1)]
            return t0 + (t1 - t0) * (positions - p0) / (p1 - p0)
        if not self.forward:
            return self._prior(positions) if self._prior_p else float(positions)
        s0, p0 = min(self.forward, key=lambda sp: (abs(sp[0] - sequences), abs(sp[1] - positions)))
        t0 = self.forward[(s0, p0)]
        if self._prior_p:
            return t0 * self._prior(positions) / self._prior(p0)
        slope = self.slope.get(s0, t0 / p0)
        return max(t0 + slope * (positions - p0), 1e-9)

    def _rest(self, sequences: int) -> float:
        if not self.rest:
            return 0.0
        return self.rest[min(self.rest, key=lambda s: abs(s - sequences))]

    def predict(self, sequences: int, positions: float, methods: Collection[str] = ()) -> float:
        """Predicted seconds of a round of ``sequences`` scoring ``positions`` (may be fractional: an expected count)
        with ``methods`` (model proposers, :data:`DRAFT_HOP`) taking part (see the class docstring)."""
        return (self.forward_seconds(sequences, positions) + self._rest(sequences)
                + sum(self.extra.get(m, 0.0) for m in methods))

    def observe(self, sequences: int, positions: int, seconds: float, methods: Collection[str] = (),
                forward: float | None = None) -> None:
        """Learn from a measured round (no prompt prefilled in it) of ``seconds`` in all, ``forward`` of them the
        target's forward (None: the transport did not say; the whole round then counts as forward)."""
        if sequences < 1 or positions < sequences or not seconds > 0:
            return
        f = forward if forward is not None and 0 < forward <= seconds else seconds
        key = (sequences, positions)
        self.forward[key] = self._ema(self.forward.get(key), f)
        same = [(p, t) for (s, p), t in self.forward.items() if s == sequences]
        if len(same) >= 2:  # the marginal seconds of a position: least squares over this S's points (noise averages)
            mp = sum(p for p, _ in same) / len(same)
            mt = sum(t for _, t in same) / len(same)
            var = sum((p - mp) ** 2 for p, _ in same)
            self.slope[sequences] = max(0.0, sum((p - mp) * (t - mt) for p, t in same) / var)
        rest = seconds - f
        if methods:
            share = max(0.0, rest - self._rest(sequences)) / len(methods)
            for m in methods:
                self.extra[m] = self._ema(self.extra.get(m), share)
        else:
            self.rest[sequences] = self._ema(self.rest.get(sequences), rest)


__all__ = ["DRAFT_HOP", "RoundCost"]
