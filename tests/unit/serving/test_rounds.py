"""spec_decode.serving.rounds: lockstep rounds of the running sequences' steps."""

from __future__ import annotations

import asyncio

from spec_decode.serving.rounds import StepRounds


class _Recorder:
    """run_round that records each round's steps and answers x -> 10 * x (a step 'fail' raises alone)."""

    def __init__(self, delay=0.01):
        self.rounds, self.delay = [], delay

    async def __call__(self, xs):
        self.rounds.append(list(xs))
        await asyncio.sleep(self.delay)
        return [ValueError(f"bad {x}") if x == "fail" else 10 * x for x in xs]


async def _sequence(rounds: StepRounds, steps: list, out: list, start_delay: float = 0.0):
    await asyncio.sleep(start_delay)
    rounds.join()
    try:
        for x in steps:
            out.append(await rounds.submit(x))
    finally:
        rounds.leave()


def test_concurrent_sequences_step_together_in_rounds():
    async def main():
        rec = _Recorder()
        rounds = StepRounds(rec, max_wait_s=1.0)  # a long wait: rounds must start because everyone submitted
        outs = [[] for _ in range(4)]
        await asyncio.gather(*(_sequence(rounds, [i] * 5, outs[i]) for i in range(4)))
        return rec, outs

    rec, outs = asyncio.run(main())
    assert outs == [[10 * i] * 5 for i in range(4)]
    # The first sequence in starts at once, alone; from then on every round holds every sequence's step.
    assert [sorted(r) for r in rec.rounds] == [[0]] + [[0, 1, 2, 3]] * 4 + [[1, 2, 3]]


def test_a_sequence_arriving_mid_round_joins_the_next_round_and_leavers_do_not_stall_it():
    async def main():
        rec = _Recorder(delay=0.05)
        rounds = StepRounds(rec, max_wait_s=1.0)
        a, b = [], []
        t0 = asyncio.get_running_loop().time()
        await asyncio.gather(_sequence(rounds, [1, 1, 1], a), _sequence(rounds, [2] * 5, b, start_delay=0.02))
        return rec, a, b, asyncio.get_running_loop().time() - t0

    rec, a, b, elapsed = asyncio.run(main())
    assert a == [10] * 3 and b == [20] * 5
    assert rec.rounds[0] == [1]  # b arrived while the first round ran
    assert sorted(rec.rounds[1]) == [1, 2] and sorted(rec.rounds[2]) == [1, 2]
    assert rec.rounds[3:] == [[2]] * 3  # a left: b's rounds start without waiting max_wait_s
    assert elapsed < 0.9


def test_a_failing_step_fails_only_its_sequence():
    async def main():
        rec = _Recorder()
        rounds = StepRounds(rec, max_wait_s=1.0)
        good, errors = [], []

        async def bad():
            rounds.join()
            try:
                await rounds.submit("fail")
            except ValueError as exc:
                errors.append(str(exc))
            finally:
                rounds.leave()

        await asyncio.gather(_sequence(rounds, [3, 3], good), bad())
        return good, errors

    good, errors = asyncio.run(main())
    assert good == [30, 30] and errors == ["bad fail"]


def test_a_straggler_is_not_waited_for_beyond_max_wait():
    async def main():
        rec = _Recorder(delay=0.0)
        rounds = StepRounds(rec, max_wait_s=0.05)
        rounds.join()  # a member that never submits (busy elsewhere)
        out = []
        t0 = asyncio.get_running_loop().time()
        await _sequence(rounds, [4], out)
        return out, asyncio.get_running_loop().time() - t0

    out, elapsed = asyncio.run(main())
    assert out == [40] and 0.04 <= elapsed < 0.5


def test_between_rounds_counts_the_members_own_work_not_a_wait_for_a_newcomer():
    async def member(rounds, steps, work_s, start_delay=0.0):
        await asyncio.sleep(start_delay)
        rounds.join()
        try:
            for x in range(steps):
                await rounds.submit(x)
                await asyncio.sleep(work_s)  # the member's own work between its steps (commit, response, inputs)
        finally:
            rounds.leave()

    async def main():
        rounds = StepRounds(_Recorder(delay=0.001), max_wait_s=5.0)
        await member(rounds, 4, 0.02)  # alone: three gaps of its own work count (the last one: it leaves)
        alone = rounds.between_s
        await member(rounds, 2, 0.0, start_delay=0.3)  # a newcomer after 0.3 s idle: that wait is not counted
        return alone, rounds.between_s

    alone, total = asyncio.run(main())
    assert 0.05 <= alone < 0.25
    assert total - alone < 0.1
