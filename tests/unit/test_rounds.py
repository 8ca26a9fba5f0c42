"""Lockstep step rounds (generate) and the batched tensor boundary (adapter): rows in, rows out."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch

from spec_decode.serving.adapter import PAD_ID, execute, stack_rows, strip_padding
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


def test_stack_rows_pads_and_strip_padding_recovers_rows():
    rows = [np.array([5, 6, 7], np.int64), np.zeros(0, np.int64), np.array([9], np.int64)]
    stacked = stack_rows(rows)
    assert stacked.shape == (3, 3) and stacked[1].tolist() == [PAD_ID] * 3
    assert [strip_padding(r) for r in stacked] == [[5, 6, 7], [], [9]]
    probs = stack_rows([torch.ones(2, 4), np.zeros((0, 0), np.float32)])  # numpy rows join torch ones
    assert isinstance(probs, torch.Tensor) and probs.shape == (2, 2, 4) and probs[1].abs().sum() == 0


def test_stack_rows_keeps_a_device_row_on_its_device_whatever_comes_first():
    # "meta" stands in for a GPU here: a row off the CPU, after the CPU zeros of rows without draft probabilities
    device_row = torch.ones(2, 4, device="meta")
    out = stack_rows([torch.zeros(0, 0), np.zeros((0, 0), np.float32), device_row])
    assert out.device.type == "meta" and out.shape == (3, 2, 4)


class _Pb:
    """The bits of pb_utils that adapter.execute uses."""

    class Tensor:
        def __init__(self, name, arr):
            self.name, self.arr = name, arr

        def is_cpu(self):
            return True

        def as_numpy(self):
            return self.arr

    class InferenceResponse:
        def __init__(self, output_tensors=None, error=None):
            self.output_tensors, self.error = output_tensors, error

    class TritonError:
        INVALID_ARG, INTERNAL = 1, 2

        def __init__(self, message, code):
            self.message, self.code = message, code

    @staticmethod
    def get_input_tensor_by_name(request, name):
        return request.get(name)


class _EchoBackend:
    """Doubles each row's ids; a row with id 13 fails."""

    INPUTS = ("ids",)

    def __init__(self):
        self.batches = []

    def run_batch(self, rows):
        self.batches.append(len(rows))
        return [ValueError("13 is unlucky") if 13 in strip_padding(r["ids"]) else
                {"out": np.asarray(strip_padding(r["ids"]), np.int64) * 2} for r in rows]


def test_execute_runs_every_row_of_every_request_together_and_fails_only_the_request_with_a_bad_row():
    be = _EchoBackend()
    req = lambda rows: {"ids": _Pb.Tensor("ids", stack_rows([np.asarray(r, np.int64) for r in rows]))}  # noqa: E731
    responses = execute(be, [req([[1, 2], [3]]), req([[13]]), req([[4, 5, 6]])], _Pb)
    assert be.batches == [4]  # one run_batch over the 4 sequences of 3 requests
    first = responses[0].output_tensors[0].arr
    assert [strip_padding(r) for r in first] == [[2, 4], [6]]
    assert responses[1].error is not None and "unlucky" in responses[1].error.message
    assert [strip_padding(r) for r in responses[2].output_tensors[0].arr] == [[8, 10, 12]]


def test_read_rows_rejects_inputs_with_different_batch_dimensions():
    be = _EchoBackend()
    bad = {"ids": _Pb.Tensor("ids", np.zeros((2, 3), np.int64))}
    be.INPUTS = ("ids", "other")
    bad["other"] = _Pb.Tensor("other", np.zeros((3, 1), np.int64))
    (resp,) = execute(be, [bad], _Pb)
    assert resp.error is not None and "batch dimension" in resp.error.message


@pytest.mark.parametrize("k_rows", [[0, 4], [2, 0, 3]])
def test_verifier_rows_padded_to_the_rounds_largest_k_equal_unpadded_rows(k_rows):
    """A verifier row cut from a padded batch (drafts padded with -1, probabilities with zero rows) gives what the
    same row gives alone, for drafts with and without draft probabilities mixed in one round."""
    from spec_decode.serving.step_models import VerifierBackend

    gen = torch.Generator().manual_seed(0)
    vocab = 11
    ver = VerifierBackend({"backend": "torch", "num_threads": "0"})  # 0: leave the test process's threads alone
    rows = []
    for i, k in enumerate(k_rows):
        tp = torch.softmax(torch.randn(k + 1, vocab, generator=gen), -1)
        drafts = torch.randint(0, vocab, (k,), generator=gen)
        dp = torch.softmax(torch.randn(k, vocab, generator=gen), -1) if i % 2 else torch.zeros(0, 0)
        rows.append({"target_probs": tp, "draft_token_ids": drafts.numpy(), "draft_probs": dp,
                     "temperature": np.array([1.0], np.float32), "random_seed": np.array([7 + i]),
                     "step": np.array([3]), "acceptance_method": np.array([b"rejection"], object)})
    alone = [ver.run(r) for r in rows]
    batch = {name: stack_rows([r[name] for r in rows])
             for name in ("target_probs", "draft_token_ids", "draft_probs")}
    for i, r in enumerate(rows):
        padded = dict(r, target_probs=batch["target_probs"][i], draft_token_ids=batch["draft_token_ids"][i],
                      draft_probs=batch["draft_probs"][i])
        got = ver.run(padded)
        assert got["output_ids"].tolist() == alone[i]["output_ids"].tolist()
        np.testing.assert_allclose(got["output_log_probs"], alone[i]["output_log_probs"], rtol=1e-6)


@pytest.mark.parametrize("backend", ["torch", "triton"])  # triton: the kernels under TRITON_INTERPRET=1
def test_a_round_is_verified_in_one_sampler_call_and_each_row_gets_what_it_gets_alone(backend, monkeypatch):
    """Rows of k 1..4, greedy and sampled, with and without draft probabilities, rejection and typical: run_batch
    gives each row the tokens run() gives it alone, with one sampler call per kind of row; a bad row fails alone."""
    import spec_decode.step as step
    from spec_decode.serving.step_models import VerifierBackend

    calls = []
    for name in ("rejection_sample", "typical_acceptance_sample"):
        real = getattr(step, name)
        monkeypatch.setattr(step, name, lambda *a, _real=real, _name=name, **kw: calls.append(_name) or _real(*a, **kw))
    gen = torch.Generator().manual_seed(1)
    vocab = 23
    ver = VerifierBackend({"backend": backend, "num_threads": "0"})
    rows = []
    for i in range(12):
        k = 1 + i % 4
        tp = torch.softmax(torch.randn(k + 1, vocab, generator=gen) * 2, -1)
        drafts = torch.argmax(tp[:k] / torch.empty(k, vocab).exponential_(generator=gen), -1)  # often accepted
        with_dp, method = i % 3 == 1, b"typical" if i % 3 == 2 else b"rejection"
        dp = torch.softmax(torch.randn(k, vocab, generator=gen), -1) if with_dp else torch.zeros(0, 0)
        rows.append({"target_probs": tp, "draft_token_ids": drafts.numpy(), "draft_probs": dp,
                     "temperature": np.array([0.0 if i % 5 == 0 else 1.0], np.float32),
                     "random_seed": np.array([100 + i]), "step": np.array([i]),
                     "acceptance_method": np.array([method], object)})
    alone = [ver.run(r) for r in rows]
    calls.clear()
    bad = dict(rows[0], target_probs=torch.ones(1, vocab) / vocab)  # 1 row of probabilities for 1 draft
    got = ver.run_batch(rows + [bad])
    # three kinds of row: rejection without and with draft probabilities, typical (its greedy rows: rejection)
    assert sorted(calls) == ["rejection_sample", "rejection_sample", "typical_acceptance_sample"]
    assert isinstance(got[-1], ValueError) and "target_probs" in str(got[-1])
    for g, a in zip(got[:-1], alone):
        assert g["output_ids"].tolist() == a["output_ids"].tolist()
        np.testing.assert_allclose(g["output_log_probs"], a["output_log_probs"], rtol=1e-6)
    assert sum(len(g["output_ids"]) - 1 for g in got[:-1]) > 0  # some drafts were accepted
