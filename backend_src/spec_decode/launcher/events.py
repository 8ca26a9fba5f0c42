"""The launcher's recovery events (the healer's and the OpenAI frontend's): one record each, one line on stderr."""

from __future__ import annotations

import sys
from typing import NamedTuple


class Event(NamedTuple):
    """A recovery event, for logs and tests.

    Attributes:
        t: ``time.monotonic()`` when it happened (seconds).
        model: what it concerns: a model, ``tritonserver`` for whole-server events, ``openai_frontend``.
        what: ``died``, ``reloading``, ``reloaded``, ``load_failed``, ``restarting``, ``restarted``,
            ``restart_failed`` or ``gave_up``.
        detail: a human-readable detail (pids, durations, the error).
    """

    t: float
    model: str
    what: str
    detail: str


def stderr_line(msg: str) -> None:
    """Write ``[spec_decode.launcher] <msg>`` on stderr in one write, so that the lines of concurrent recoveries do
    not run together."""
    sys.stderr.write(f"[spec_decode.launcher] {msg}\n")
    sys.stderr.flush()
