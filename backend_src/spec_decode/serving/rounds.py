"""Lockstep rounds: the steps of all running sequences start together, so that they share forward passes.

Each request's generation loop is an asyncio task in the ``generate`` model. Steps sent independently through the
``spec_step`` ensemble (draft_model -> target_model -> verifier, each its own process with Triton's dynamic batcher)
fall into groups that stay out of phase: while the target runs group A, group B is being verified and drafted,
reaches the target as a batch of its own, and the two never merge (docs/benchmarks.md has the measurement).
:class:`StepRounds` does what vLLM's scheduler does (one scheduler iteration runs a step of every running sequence): a
round starts once every sequence in the loop has submitted its next step (or ``max_wait_s`` after the first
submission, should one be slow to come back), and one round runs at a time. Sequences that arrive during a round join
the next one. With a single sequence a step starts at once, so a lone stream pays nothing. The round itself is handed
to one function (``generate`` sends it as one batched request through the ensemble, so each model sees the whole round
in one ``execute``).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Generic, TypeVar

InputT = TypeVar("InputT")  # a step's inputs
ResultT = TypeVar("ResultT")  # a step's result


class StepRounds(Generic[InputT, ResultT]):
    """Starts the steps of the sequences in the generation loop in rounds (asyncio; one event loop).

    Args:
        run_round: coroutine function, list of steps' inputs -> list (same length, same order) of each step's result
            or the exception that fails that step alone; an exception it raises fails every step of the round, and a
            list of another length fails it with a RuntimeError.
        max_wait_s: seconds a submitted step waits for the other sequences in the loop before its round starts
            without them (> 0). Sequences normally resubmit within microseconds of their round's end; this only bounds
            the wait when one does not (it is awaiting something else, or leaving).

    Usage: a sequence calls :meth:`join` when its loop starts, ``await submit(x)`` for each step (returns the step's
    result or raises its exception, to this caller only) and :meth:`leave` when its loop ends, in every case
    (``finally``).

    Attributes:
        between_s: seconds since start from a round's end to the next round's start, counted when the next round
            starts because the same sequences (less any that left) all came back: their own work between rounds
            (commits, responses, the next steps' inputs), never a wait for a new arrival or a slow member.

    Raises:
        ValueError: ``max_wait_s`` <= 0.
    """

    def __init__(self, run_round: Callable[[list[InputT]], Awaitable[Sequence[ResultT | BaseException]]],
                 max_wait_s: float = 0.02):
        if not max_wait_s > 0:
            raise ValueError(f"max_wait_s must be > 0, got {max_wait_s}")
        self.run_round = run_round
        self.max_wait_s = max_wait_s
        self.members = 0  # sequences in the generation loop
        self.rounds = 0  # rounds started (for tests)
        self.in_flight = False
        self._pending: list[tuple[InputT, asyncio.Future[ResultT]]] = []
        self._timer: asyncio.TimerHandle | None = None
        self._task: asyncio.Task | None = None  # the round in flight (a reference keeps it from being collected)
        self._ended: float | None = None  # when the last round's results were handed out
        # seconds from a round's end to the next one's start, when the same sequences (less any that left) all came
        # back: their own work between rounds (commits, responses, the next inputs), never a wait for a new arrival
        self.between_s = 0.0

    def join(self) -> None:
        """A sequence enters the generation loop."""
        self.members += 1
        self._ended = None  # the next round waits on a newcomer: not the members' own work

    def leave(self) -> None:
        """A sequence leaves the generation loop (finished, cancelled or failed); the others need not wait for it."""
        self.members -= 1
        self._maybe_start()

    async def submit(self, x: InputT) -> ResultT:
        """Run step ``x`` in the next round; returns its result (raises its exception)."""
        fut: asyncio.Future[ResultT] = asyncio.get_running_loop().create_future()
        self._pending.append((x, fut))
        self._maybe_start()
        return await fut

    def _maybe_start(self) -> None:
        if self.in_flight or not self._pending:
            return
        if len(self._pending) >= self.members:
            if self._ended is not None:
                self.between_s += time.perf_counter() - self._ended
            self._start()
        elif self._timer is None:
            self._timer = asyncio.get_running_loop().call_later(self.max_wait_s, self._on_timer)

    def _on_timer(self) -> None:
        self._timer = None
        if not self.in_flight and self._pending:
            self._start()

    def _start(self) -> None:
        self._ended = None
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        batch, self._pending = self._pending, []
        self.in_flight = True
        self.rounds += 1
        self._task = asyncio.get_running_loop().create_task(self._run(batch))

    async def _run(self, batch) -> None:
        results: list | BaseException = RuntimeError("the step round was interrupted")
        try:
            results = list(await self.run_round([x for x, _ in batch]))
            if len(results) != len(batch):
                results = RuntimeError(f"run_round returned {len(results)} results for {len(batch)} steps")
        except Exception as exc:  # noqa: BLE001 - fails every step of this round
            results = exc
        finally:  # every caller gets its own result or exception, even if this task is cancelled (shutdown)
            self.in_flight = False
            for i, (_, fut) in enumerate(batch):
                if fut.done():
                    continue
                r = results if isinstance(results, BaseException) else results[i]
                if isinstance(r, BaseException):
                    fut.set_exception(r)
                else:
                    fut.set_result(r)
            self._ended = time.perf_counter()
            self._maybe_start()
