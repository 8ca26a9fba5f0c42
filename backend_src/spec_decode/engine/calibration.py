"""The target's cost of scoring n positions, measured at load and handed to ``generate``'s ``auto`` controller.

target_model times its own forward pass over one sequence scoring n new positions (n in :data:`POSITIONS`) on a
short scratch context right after it loads (a second or two on a CPU), and writes the medians to a JSON file that the
``generate`` model of the same server reads (:class:`~spec_decode.auto.RoundCost` uses the curve's shape until
round times are measured). The file lives under the temporary directory, named by the parent process: every
Python-backend model process is a child of the tritonserver that started it, so the models of one server share
it and two servers on one machine do not.
"""

from __future__ import annotations

import json
import os
import statistics
import tempfile
import time
from pathlib import Path

from ..sampling import SamplingParams

POSITIONS = (1, 2, 3, 5, 9, 17)  # new positions per forward: k + 1 for k = 0, 1, 2, 4, 8 and a round of several
CONTEXT = 64  # scratch context tokens
_SCRATCH_SEQ = (1 << 63) - 7  # generate draws random 63-bit ids: one equal to this at load has odds of 2**-63


def calibration_path() -> Path:
    """This server's calibration file: ``$TMPDIR/spec_decode-<tritonserver pid>/target_cost.json``."""
    return Path(tempfile.gettempdir()) / f"spec_decode-{os.getppid()}" / "target_cost.json"


def measure_score_cost(scorer, vocab_size: int, positions=POSITIONS, repeats: int = 5) -> dict[int, float]:
    """Median seconds of the target's forward over one sequence scoring each number of new positions, made
    non-decreasing (:func:`lower_envelope`).

    Args:
        scorer: a :class:`~spec_decode.engine.scorer.TargetScorer`.
        vocab_size: the target's vocabulary (the scratch ids lie below it).
        positions: the numbers of new positions (>= 1 each).
        repeats: timed forwards per number (>= 1), after one untimed warm-up forward.

    Returns:
        positions -> seconds (median of ``repeats``, then the lower envelope).

    Raises:
        ValueError: a number of positions < 1 or repeats < 1.
    """
    if repeats < 1 or any(p < 1 for p in positions):
        raise ValueError(f"positions must be >= 1 and repeats >= 1, got {positions}, {repeats}")
    ids = [(7 * i + 3) % max(2, vocab_size) for i in range(CONTEXT)]
    params = SamplingParams()
    out: dict[int, float] = {}
    try:
        scorer.score_batch([(_SCRATCH_SEQ, ids, [], params)])  # prefill the context once, and warm up
        for n in positions:
            drafts = [(11 * j + 5) % max(2, vocab_size) for j in range(n - 1)]
            times = []
            for _ in range(repeats):
                start = time.perf_counter()
                scorer.score_batch([(_SCRATCH_SEQ, ids, drafts, params)])
                times.append(time.perf_counter() - start)
            out[n] = statistics.median(times)
    finally:
        scorer.release(_SCRATCH_SEQ)
    return lower_envelope(out)


def lower_envelope(seconds_by_positions: dict[int, float]) -> dict[int, float]:
    """The curve made non-decreasing by lowering each point to the smallest time at as many positions or more: a
    forward disturbed by other work at load (the other models load beside it) reads as an outlier above the
    rest, never below, and scoring more positions never costs less."""
    out: dict[int, float] = {}
    low = float("inf")
    for n in sorted(seconds_by_positions, reverse=True):
        low = min(low, seconds_by_positions[n])
        out[n] = low
    return dict(sorted(out.items()))


def save_calibration(seconds_by_positions: dict[int, float], path: Path | None = None) -> Path:
    """Write the curve atomically (a reader never sees half a file); returns the path."""
    path = path or calibration_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps({str(p): s for p, s in seconds_by_positions.items()}))
    os.replace(tmp, path)
    return path


def load_calibration(path: Path | None = None, not_before: float = 0.0) -> dict[int, float] | None:
    """The curve target_model saved, or None when there is none (not yet written, unreadable, or last written
    before ``not_before``, a ``time.time()``: a file an earlier server with the same process id left)."""
    path = path or calibration_path()
    try:
        if path.stat().st_mtime < not_before:
            return None
        raw = json.loads(path.read_text())
        curve = {int(p): float(s) for p, s in raw.items()}
    except (OSError, ValueError, AttributeError):
        return None
    return curve if curve and all(p >= 1 and s > 0 for p, s in curve.items()) else None


__all__ = ["POSITIONS", "calibration_path", "load_calibration", "lower_envelope", "measure_score_cost",
           "save_calibration"]
