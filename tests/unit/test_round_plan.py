"""spec_decode.scheduler.plan: one frozen plan per round (speculation under load, auto, the token budget) and the one
loop both transports run (plan, run, observe), synchronous or awaited."""

import asyncio
import dataclasses
import time

import pytest

from spec_decode.protocol import AUTO, StepInputs, StepResult
from spec_decode.sampling import SamplingParams
from spec_decode.scheduler.auto import AutoController
from spec_decode.scheduler.plan import RoundPlan, Scheduler, run_sync


def _step(seq_id, k=4, method="suffix", n_ids=20, cached=19):
    return StepInputs(seq_id, list(range(n_ids)), k, method, SamplingParams(), 0, cached_len=cached,
                      auto=method == AUTO)


def test_step_inputs_are_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        _step(1).num_draft_tokens = 0  # type: ignore[misc]


def test_the_plan_applies_the_load_policy_auto_and_the_budget_to_copies():
    steps = [_step(1), _step(2, method=AUTO), _step(3, n_ids=400, cached=0)]
    kept = [dataclasses.replace(s) for s in steps]
    sched = Scheduler(max_num_batched_tokens=64, disable_by_batch_size=8, auto=AutoController(["suffix"]))
    plan = sched.plan(steps, running=3)
    assert steps == kept  # nothing submitted changed
    assert plan.steps == tuple(steps) and plan.runs[0] is steps[0]
    assert plan.runs[1].auto and plan.runs[1].method in ("suffix", "none")  # auto's choice, on a copy
    third = plan.runs[2]
    assert third is not None and third.num_scheduled_tokens > 0 and third.num_draft_tokens == 0
    loaded = sched.plan(steps, running=8)  # disable_by_batch_size reached: no step drafts
    assert all(not r.drafts for r in loaded.ran) and steps == kept
    assert sched.plan_seconds > 0
    with pytest.raises(ValueError, match="AutoController"):
        Scheduler().plan([_step(4, method=AUTO)])


def test_a_waiting_step_runs_nothing_and_keeps_its_place():
    busy = [_step(s, k=7, n_ids=100, cached=99) for s in range(12)]  # 96 positions: over the budget
    plan = Scheduler(max_num_batched_tokens=64).plan(busy + [_step(98, n_ids=500, cached=0),
                                                             _step(99, n_ids=500, cached=0)])
    assert plan.runs[-1] is None and plan.as_run(13) is plan.steps[13] and len(plan.ran) == 13


def test_run_round_is_one_loop_for_a_plain_and_an_async_transport():
    steps = [_step(1), _step(2, n_ids=300, cached=0)]
    seen: list[list[StepInputs]] = []

    def plain(ran):
        seen.append(ran)
        return [StepResult([7, 8], r.num_draft_tokens, forward_seconds=0.01, cached_tokens=r.cached_len)
                if len(r.token_ids) - r.cached_len < 64 else StepResult([], 0, cached_tokens=0, forward_seconds=0.01)
                for r in ran]

    async def awaited(ran):
        await asyncio.sleep(0)
        return plain(ran)

    sched = Scheduler(max_num_batched_tokens=64)
    plan, results = run_sync(sched.run_round(steps, plain))
    assert isinstance(plan, RoundPlan) and seen[-1] == plan.ran
    assert results[0].output_ids == [7, 8] and results[1].prefilled == 59  # the chunk: its share past 0 cached
    plan2, results2 = asyncio.run(sched.run_round(steps, awaited))
    assert plan2 == plan and [r.prefilled for r in results2] == [r.prefilled for r in results]
    with pytest.raises(RuntimeError, match="event loop"):
        run_sync(sched.run_round(steps, awaited))


def test_auto_learns_the_forward_seconds_the_results_carry():
    ctrl = AutoController(["suffix"])
    sched = Scheduler(auto=ctrl)

    def execute(ran):
        time.sleep(0.006)  # the round: a 4 ms forward and the rest
        return [StepResult([1] * (r.num_draft_tokens + 1), r.num_draft_tokens, cached_tokens=19,
                           forward_seconds=0.004) for r in ran]

    for _ in range(3):
        run_sync(sched.run_round([_step(1, method=AUTO)], execute))
    assert ctrl.cost.forward and all(v == pytest.approx(0.004) for v in ctrl.cost.forward.values())
    assert ctrl.cost.rest[1] >= 0.001  # the round's time beyond its forward, apart
    sched.release(1)
    assert ctrl.sequences == {}
