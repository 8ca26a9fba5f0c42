"""One round's plan and the one loop that runs it: plan, run, observe.

A round holds the next step of every sequence in the generation loop (generate's lockstep rounds:
:mod:`spec_decode.serving.rounds`; one sequence at a time in process: :func:`spec_decode.in_process.run_local`).
:class:`Scheduler` turns the steps the sequences submitted into a frozen :class:`RoundPlan`, applying in order vLLM's
``disable_by_batch_size`` (:func:`~.k_schedule.speculation_disabled`), ``speculative_method=auto``'s choice of method
and k (:class:`~.auto.AutoController`) and the round's token budget (:func:`~.chunked_prefill.plan_round`). Each of
those returns new step inputs; the submitted ones are never changed. :meth:`Scheduler.run_round` is the loop both
transports use: plan, hand the steps that run to the transport, map the results back to the submitted steps, and
let ``auto`` learn from the round (its time, and the target's forward seconds the results carry).
"""

from __future__ import annotations

import inspect
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, replace
from typing import TypeVar

from ..protocol import StepInputs, StepResult
from .auto import AutoController
from .chunked_prefill import plan_round, round_results
from .k_schedule import speculation_disabled

T = TypeVar("T")
Outcome = StepResult | BaseException


@dataclass(frozen=True)
class RoundPlan:
    """What one round runs.

    Attributes:
        steps: the steps the sequences submitted, in order.
        runs: per step, what it runs (its method and k chosen, its share of the token budget: new inputs where any
            differ), or None: it waits for a later round.
    """

    steps: tuple[StepInputs, ...]
    runs: tuple[StepInputs | None, ...]

    @property
    def ran(self) -> list[StepInputs]:
        """The steps that run, in order: what the transport gets."""
        return [r for r in self.runs if r is not None]

    def as_run(self, i: int) -> StepInputs:
        """Step ``i`` as it ran (as submitted when it waited)."""
        run = self.runs[i]
        return run if run is not None else self.steps[i]


class Scheduler:
    """The round's policy: speculation disabled under load, ``auto``'s choices, the token budget; and what ``auto``
    learns from each round.

    Args:
        max_num_batched_tokens: the round's budget of new target positions (0: none; :mod:`.chunked_prefill`).
        disable_by_batch_size: with this many running sequences or more, steps run without drafts (0: never).
        auto: the controller of ``speculative_method=auto`` steps (None: such a step raises ValueError at plan).

    Attributes:
        plan_seconds: seconds spent planning since construction.
    """

    def __init__(self, max_num_batched_tokens: int = 0, disable_by_batch_size: int = 0,
                 auto: AutoController | None = None):
        self.max_num_batched_tokens = max_num_batched_tokens
        self.disable_by_batch_size = disable_by_batch_size
        self.auto = auto
        self.plan_seconds = 0.0

    def plan(self, steps: Sequence[StepInputs], running: int | None = None) -> RoundPlan:
        """The round's plan for ``steps``, with ``running`` sequences in the generation loop (default: the steps').

        Raises:
            ValueError: an ``auto`` step and no controller.
        """
        start = time.perf_counter()
        runs = list(steps)
        if speculation_disabled(len(steps) if running is None else running, self.disable_by_batch_size):
            runs = [replace(r, num_draft_tokens=0) if r.num_draft_tokens else r for r in runs]
        if any(r.auto for r in runs):
            if self.auto is None:
                raise ValueError("speculative_method=auto needs an AutoController")
            runs = self.auto.plan(runs)
        plan = RoundPlan(tuple(steps), tuple(plan_round(runs, self.max_num_batched_tokens)))
        self.plan_seconds += time.perf_counter() - start
        return plan

    def observe(self, plan: RoundPlan, results: Sequence[Outcome], seconds: float) -> None:
        """Learn from a round that took ``seconds`` (``results``: per submitted step, :meth:`run_round`'s)."""
        if self.auto is not None:
            self.auto.observe([plan.as_run(i) for i in range(len(plan.steps))], results, seconds)

    def release(self, seq_id: int) -> None:
        """Forget a finished sequence."""
        if self.auto is not None:
            self.auto.release(seq_id)

    async def run_round(self, steps: Sequence[StepInputs],
                        execute: Callable[[list[StepInputs]], Sequence[Outcome] | Awaitable[Sequence[Outcome]]],
                        running: int | None = None) -> tuple[RoundPlan, list[Outcome]]:
        """Plan a round, run it and learn from it: the loop of both transports.

        Args:
            steps: the submitted steps. running: sequences in the generation loop (default: the steps').
            execute: the transport: the steps that run -> per step its result or the exception that fails it
                (a coroutine function, or a plain one: :func:`run_sync` then drives this without an event loop).

        Returns:
            the plan, and per submitted step its result or exception (a prompt chunk's and a waiting step's
            carry ``prefilled``: :func:`~.chunked_prefill.round_results`).

        Raises:
            ValueError: as :meth:`plan`, or ``execute`` returned a result count other than the steps run.
            Exception: what ``execute`` raises.
        """
        plan = self.plan(steps, running)
        start = time.perf_counter()
        ran = plan.ran
        raw = execute(ran) if ran else []
        if inspect.isawaitable(raw):
            raw = await raw
        results = round_results(plan.steps, plan.runs, list(raw))
        self.observe(plan, results, time.perf_counter() - start)
        return plan, results


def run_sync(coroutine: Awaitable[T]) -> T:
    """Drive a coroutine that never suspends (:meth:`Scheduler.run_round` over a plain ``execute``) to its result.

    Raises:
        RuntimeError: the coroutine suspended (it awaits real I/O: run it in an event loop).
    """
    coro = coroutine.__await__()
    try:
        next(coro)
    except StopIteration as done:
        return done.value
    coro.close()
    raise RuntimeError("run_sync: the round awaited something; run it in an event loop")


__all__ = ["RoundPlan", "Scheduler", "run_sync"]
