"""Serving the rows of one ``execute()`` together: sequences share forward passes, and one row's error fails it alone.

Triton's dynamic batcher hands a step model every request that queued while it ran, and each request of a round holds
one row per sequence (:func:`~.adapter.execute`). A backend plans each row (answered at once, e.g. a release, or a
:class:`Work` for a batched call), and :func:`run_batched` runs the planned work in as few batched calls as the rows
allow.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import Any

from ..settings import ConfigSettings, warn_unknown_parameters
from .metrics import Metrics
from .step_inputs import is_release


class Work:
    """A row's share of a batched call.

    Args:
        seq_id: the row's sequence (a sequence appears at most once per call).
        args: the row's argument of the batched call.
        finish: the call's result for this row -> the row's outputs dict.
        group: rows of different groups go to different calls (draft_model: one per method).
    """

    def __init__(self, seq_id: int, args, finish: Callable, group: Hashable = None):
        self.seq_id, self.args, self.finish, self.group = seq_id, args, finish, group


def run_batched(inputs_list: list[dict], plan: Callable, run_group: Callable) -> list:
    """Run several rows, sharing batched calls where they can.

    Args:
        inputs_list: the rows' inputs.
        plan: inputs -> outputs dict (answered alone, e.g. a release) or a :class:`Work`; may raise.
        run_group: (group, list of Work args with distinct seq_ids) -> list of results, in order; may raise.

    Returns:
        per row, its outputs dict or the exception that fails it (one row's error never fails another's; a failing
        batched call fails the rows in that call).
    """
    results: list = [None] * len(inputs_list)
    work: list[tuple[int, Work]] = []
    for i, inputs in enumerate(inputs_list):
        try:
            r = plan(inputs)
        except Exception as exc:  # noqa: BLE001 - this row's error response
            r = exc
        if isinstance(r, Work):
            work.append((i, r))
        else:
            results[i] = r
    while work:  # a sequence appears at most once per call (only direct callers can send one twice)
        calls: dict[Hashable, list[tuple[int, Work]]] = {}
        rest: list[tuple[int, Work]] = []
        seen: set[tuple[Hashable, int]] = set()
        for i, w in work:
            (rest if (w.group, w.seq_id) in seen else calls.setdefault(w.group, [])).append((i, w))
            seen.add((w.group, w.seq_id))
        work = rest
        for group, call in calls.items():
            try:
                outs = run_group(group, [w.args for _, w in call])
                for (i, w), out in zip(call, outs):
                    results[i] = w.finish(out)
            except Exception as exc:  # noqa: BLE001
                for i, _ in call:
                    results[i] = exc
    return results


class BatchedBackend:
    """``run``/``run_batch`` of a step model whose rows share batched calls.

    Args:
        params: the model's config.pbtxt parameters (name -> string value): ``self.settings`` is ``Settings`` built
            from them; a parameter neither it nor ``extra_parameters`` names is warned about.
        metrics: where the model's metrics go (default: kept in the process only).
        extra_parameters: further parameter keys the model reads (draft_model: its proposers').

    Class attributes:
        MODEL: the model's name in the repository. Settings: its settings class (:mod:`spec_decode.settings`).

    Subclasses define :meth:`_plan` and :meth:`_run_group`, and may override ``_refresh_gauges()`` (after every
    execute) and ``_is_release(inputs)``.

    Raises:
        ValueError: (construction) a config parameter out of range (named).
    """

    MODEL: str = ""
    Settings: type[ConfigSettings] = ConfigSettings

    def __init__(self, params: dict[str, str], metrics: Metrics | None = None, extra_parameters=()):
        warn_unknown_parameters(self.MODEL, params, {*self.Settings.parameter_names(), *extra_parameters})
        self.metrics = metrics if metrics is not None else Metrics()
        self.settings = self.Settings.from_params(params)

    def run(self, inputs: dict) -> dict:
        """Serve one row alone.

        Raises:
            ValueError: an invalid input (named).
        """
        (result,) = self.run_batch([inputs])
        if isinstance(result, Exception):
            raise result
        return result

    def run_batch(self, inputs_list: list[dict]) -> list:
        """Serve the rows of one ``execute()`` (a round, and requests that queued with it), sharing batched calls.

        Returns:
            per row, its outputs or the exception that fails it (see :func:`run_batched`).
        """
        try:
            return run_batched(inputs_list, self._plan, self._run_group)
        finally:
            self._refresh_gauges()
            if any(self._is_release(i) for i in inputs_list):  # a sequence ended: export its figures
                self.metrics.flush()

    def _plan(self, inputs: dict) -> dict | Work:
        """A row's outputs when it is answered alone (a release), else its :class:`Work`; raises for a bad row."""
        raise NotImplementedError

    def _run_group(self, group: Any, args: list) -> list:
        """One batched call over the ``Work.args`` of a group's rows (distinct seq_ids): a result per row, in order."""
        raise NotImplementedError

    def _refresh_gauges(self) -> None:
        """Set the model's cache gauges (none by default)."""

    @staticmethod
    def _is_release(inputs: dict) -> bool:
        return is_release(inputs)
