"""The seconds a round of speculative steps costs, as a function of its sequences and the positions it scores.

``speculative_method=auto`` (:mod:`spec_decode.auto`) weighs expected tokens against these seconds. The model is
measured on the server it runs in: target_model's calibration at load (:mod:`spec_decode.engine.calibration`) gives
the shape, and every round generate runs gives the level (docs/auto.md).
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Collection

DRAFT_HOP = "draft_model"  # the cost of a round going through draft_model at all (RoundCost.extra's key)


class RoundCost:
    """The seconds a round costs as a function of its sequences S and the positions P it scores.

    Measured rounds (:meth:`observe`) are kept per (S, P) as exponential moving averages. A prediction for an
    (S, P) not measured is, between two measured P of the same S, their linear interpolation; otherwise the
    nearest measured point scaled by the target's calibration curve (seconds of one sequence scoring n new
    positions, measured by target_model at load: :mod:`spec_decode.engine.calibration`), or by nothing (flat: the
    point is then tried and measured) without a calibration. Before any round is measured, the calibration curve
    itself. A model proposer (the draft LM, a head) adds its own seconds to a round it drafts in, and a round that
    goes through draft_model at all the hop's (:data:`DRAFT_HOP`; rounds without drafts skip it), each learned as
    the measured round time above the prediction. ``positions`` may be fractional (an expected count).

    Args:
        weight: the moving averages' weight of a new measurement, in (0, 1].
        calibration: positions -> seconds of one sequence's target forward, or None.

    Raises:
        ValueError: weight outside (0, 1], or a calibration with a position < 1 or a time <= 0.
    """

    def __init__(self, weight: float = 0.2, calibration: dict[int, float] | None = None):
        if not 0.0 < weight <= 1.0:
            raise ValueError(f"weight must be in (0, 1], got {weight}")
        self.weight = weight
        self.points: dict[tuple[int, int], float] = {}  # (sequences, positions) -> seconds
        self.extra: dict[str, float] = {}  # model proposer -> seconds it adds to a round
        self._cal_p: list[int] = []
        self._cal_s: list[float] = []
        if calibration:
            self.calibrate(calibration)

    @property
    def calibrated(self) -> bool:
        """Whether a calibration curve is set."""
        return bool(self._cal_p)

    def calibrate(self, seconds_by_positions: dict[int, float]) -> None:
        """Set the calibration curve (positions -> seconds of one sequence; at least one point).

        Raises:
            ValueError: no point, a position < 1 or a time <= 0.
        """
        items = sorted((int(p), float(s)) for p, s in seconds_by_positions.items())
        if not items or items[0][0] < 1 or any(s <= 0 for _, s in items):
            raise ValueError(f"calibration needs positions >= 1 and times > 0, got {seconds_by_positions}")
        self._cal_p = [p for p, _ in items]
        self._cal_s = [s for _, s in items]

    def shape(self, positions: float) -> float:
        """The calibration curve at ``positions``: linear between its points, extended with its last slope (never
        decreasing) past the largest and flat below the smallest; 1.0 without a calibration."""
        ps, ss = self._cal_p, self._cal_s
        if not ps:
            return 1.0
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
        slope = max(0.0, (s1 - s0) / (p1 - p0))
        return s0 + slope * (positions - p0)

    def predict(self, sequences: int, positions: float, methods: Collection[str] = ()) -> float:
        """Predicted seconds of a round of ``sequences`` scoring ``positions`` with the model proposers ``methods``
        drafting in it (see the class docstring)."""
        base = self._base(sequences, positions)
        return base + sum(self.extra.get(m, 0.0) for m in methods)

    def _base(self, sequences: int, positions: float) -> float:
        exact = self.points.get((sequences, int(positions))) if positions == int(positions) else None
        if exact is not None:
            return exact
        same = sorted(p for s, p in self.points if s == sequences)
        below = [p for p in same if p < positions]
        above = [p for p in same if p > positions]
        if below and above:
            p0, p1 = below[-1], above[0]
            t0, t1 = self.points[(sequences, p0)], self.points[(sequences, p1)]
            return t0 + (t1 - t0) * (positions - p0) / (p1 - p0)
        if not self.points:
            return self.shape(positions)
        s_near, p_near = min(self.points, key=lambda sp: (abs(sp[0] - sequences), abs(sp[1] - positions)))
        return self.points[(s_near, p_near)] * self.shape(positions) / self.shape(p_near)

    def observe(self, sequences: int, positions: int, seconds: float, methods: Collection[str] = ()) -> None:
        """Learn from a measured round (no prompt prefilled in it): its time, less the model proposers' share,
        updates the (sequences, positions) average; the rest above the prediction updates each proposer's share
        (split evenly when several drafted)."""
        if sequences < 1 or positions < sequences or not seconds > 0:
            return
        w = self.weight
        if methods:
            residual = max(0.0, seconds - self._base(sequences, positions)) / len(methods)
            for m in methods:
                old = self.extra.get(m)
                self.extra[m] = residual if old is None else (1 - w) * old + w * residual
        base = max(seconds - sum(self.extra.get(m, 0.0) for m in methods), 1e-9)
        old = self.points.get((sequences, positions))
        self.points[(sequences, positions)] = base if old is None else (1 - w) * old + w * base


__all__ = ["DRAFT_HOP", "RoundCost"]
