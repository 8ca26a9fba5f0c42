"""spec_decode.serving.triton_step: the BLS transport (which ensemble a round goes to; releases sent again after a
reload)."""

import asyncio

import numpy as np

from spec_decode.generation import Generation
from spec_decode.protocol import StepInputs
from spec_decode.request import GenerationRequest
from spec_decode.sampling import SamplingParams
from spec_decode.serving.triton_step import TritonStep
from tests.fake_pb_utils import FakePbUtils, InferenceRequest, InferenceResponse, Tensor, TritonError


def test_rounds_without_drafts_skip_draft_model(real_tokenizer):
    """generate's transport: a round in which no sequence drafts goes to score_step (target_model -> verifier, empty
    drafts); a round with one drafting sequence, and every release, goes through spec_step."""

    class _Bls(InferenceRequest):
        sent = []

        @staticmethod
        def respond(req):
            b = len(req.inputs["sequence_id"])
            out = [Tensor("output_ids", np.full((b, 1), 7)), Tensor("output_log_probs", np.zeros((b, 1)))]
            if "draft_token_ids" in req.outputs:
                out.append(Tensor("draft_token_ids", np.full((b, 2), -1)))
            return InferenceResponse(out)

    class _Pb(FakePbUtils):
        InferenceRequest = _Bls

    sent = _Bls.sent
    step = TritonStep(_Pb)
    sampled = SamplingParams(temperature=0.7)  # greedy rows alone would go to target_model (the next test)
    plain = StepInputs(1, [3, 4], 0, "suffix", sampled, 0)
    none = StepInputs(2, [3, 4, 5], 4, "none", SamplingParams(), 0)
    drafting = StepInputs(3, [3], 4, "ngram", SamplingParams(), 0)
    results = asyncio.run(step.run_batch([plain, none]))
    assert sent[-1].model == "score_step" and [r.output_ids for r in results] == [[7], [7]]
    assert sent[-1].inputs["draft_token_ids"].shape == (2, 0) and sent[-1].inputs["draft_probs"].shape == (2, 0, 0)
    assert "num_draft_tokens" not in sent[-1].inputs and all(r.num_draft_tokens == 0 for r in results)
    asyncio.run(step.run_batch([plain, drafting]))
    assert sent[-1].model == "spec_step" and sent[-1].inputs["num_draft_tokens"].ravel().tolist() == [0, 4]
    gen = Generation(9, [3, 4], GenerationRequest("x", 4, speculative_method="none"), real_tokenizer, [], 256, 1)
    asyncio.run(step.release(gen))
    assert sent[-1].model == "spec_step" and bool(sent[-1].inputs["release"].all())


def test_greedy_rounds_skip_the_verifier(real_tokenizer):
    """A round whose rows are all greedy without log-probs skips the verifier: without drafts it goes to target_model
    alone, with drafts to greedy_step (draft_model -> target_model), each with only the inputs it declares; the
    target's argmax is walked as the verifier walks it (the same ids and float32 log-probs), and a row the target
    scored nothing for (a prompt chunk: no argmax) gets no token. A sampled row, or one asking for log-probs or
    prompt log-probs, sends the round through the verifier (score_step, spec_step)."""
    import torch

    from spec_decode.processors import ProcessorSpec
    from spec_decode.serving.wire import MODELS
    from spec_decode.verifier import argmax_walk

    class _Bls(InferenceRequest):
        sent = []

        @staticmethod
        def respond(req):
            b = len(req.inputs["sequence_id"])
            if req.model in ("target_model", "greedy_step"):
                # row 0: drafts [11, 12] with argmax [11, 5, 6] (one accepted); row 1: a prompt chunk, scored nothing;
                # row 2: drafts [13] all accepted, then the bonus 14
                best = np.array([[11, 5, 6], [-1, -1, -1], [13, 14, -1]])[:b]
                probs = np.array([[0.5, 0.25, 0.1], [0, 0, 0], [0.25, 0.5, 0]], np.float32)[:b]
                out = [Tensor("target_argmax", best), Tensor("target_argmax_probs", probs)]
                if "draft_token_ids" in req.outputs:
                    out.append(Tensor("draft_token_ids", np.array([[11, 12], [-1, -1], [13, -1]])[:b]))
            else:
                out = [Tensor("output_ids", np.full((b, 1), 7)), Tensor("output_log_probs", np.zeros((b, 1)))]
            out += [Tensor("num_cached_tokens", np.full((b, 1), 2, np.int32)),
                    Tensor("target_forward_seconds", np.full((b, 1), 0.01, np.float32))]
            return InferenceResponse(out)

    class _Pb(FakePbUtils):
        InferenceRequest = _Bls

    sent = _Bls.sent
    step = TritonStep(_Pb)
    plain = [StepInputs(i, [3, 4], 0, "none", SamplingParams(), 0) for i in range(3)]
    drafting = [StepInputs(i, [3, 4], 2, "ngram", SamplingParams(), 0) for i in range(3)]
    for rows, model, drafts in ((plain, "target_model", []), (drafting, "greedy_step", [11, 12])):
        results = asyncio.run(step.run_batch(rows))
        assert sent[-1].model == model and set(sent[-1].inputs) <= set(MODELS[model].input_names)
        assert "acceptance_method" not in sent[-1].inputs and "num_cached_tokens" in sent[-1].outputs
        want = argmax_walk([11, 5, 6], torch.tensor([0.5, 0.25, 0.1]), drafts)
        assert (results[0].output_ids, results[0].log_probs) == want and results[1].output_ids == []
        assert results[0].cached_tokens == 2
    assert [r.output_ids for r in results] == [[11, 5], [], [13, 14]]
    assert [r.num_draft_tokens for r in results] == [2, 0, 1]
    logprobs = ProcessorSpec(prompt_len=2, logprobs=True)
    first_prompt = ProcessorSpec(prompt_len=2, prompt_logprobs=0)
    for rows in (plain, drafting):
        for other in (StepInputs(5, [3, 4], 0, "none", SamplingParams(temperature=0.5), 0),
                      StepInputs(5, [3, 4], 0, "none", SamplingParams(), 0, processors=logprobs),
                      StepInputs(5, [3, 4], 0, "none", SamplingParams(), 0, processors=first_prompt)):
            asyncio.run(step.run_batch([rows[0], other]))
            assert sent[-1].model == ("score_step" if rows is plain else "spec_step"), other


def test_a_release_that_fails_during_a_reload_is_sent_again_after_the_next_one(real_tokenizer):
    """While a model of the ensemble reloads, releases fail and the other models keep the caches: such a release is
    kept and sent again, in chunks of the ensemble's batch size, after the next release that succeeds. A release that
    fails while every model is ready (bad input) is dropped, so it cannot block later ones."""
    state = {"fail": True, "ready": False}

    class _Bls(InferenceRequest):
        sent = []

        @staticmethod
        def respond(req):
            if state["fail"]:
                return InferenceResponse(error=TritonError("Model 'spec_step' is not ready."))
            return InferenceResponse()

    class _Pb(FakePbUtils):
        InferenceRequest = _Bls

        @staticmethod
        def is_model_ready(name):
            return state["ready"]

    sent = _Bls.sent
    rows = lambda: [r.inputs["sequence_id"].ravel().tolist() for r in sent]  # noqa: E731
    step = TritonStep(_Pb, max_batch_size=2)
    gens = [Generation(i, [3, 4], GenerationRequest("x", 4, speculative_method="none"), real_tokenizer, [], 256, 1)
            for i in range(1, 6)]
    for g in gens[:3]:
        asyncio.run(step.release(g))  # the ensemble is not ready: each is tried once and kept
    assert rows() == [[1], [2], [3]]
    state.update(fail=False, ready=True)
    sent[:] = []
    asyncio.run(step.release(gens[3]))
    assert rows()[0] == [4] and sorted(sum(rows()[1:], [])) == [1, 2, 3] and len(rows()) == 3  # chunks of 2
    assert all(bool(r.inputs["release"].all()) for r in sent)
    state.update(fail=True, ready=True)  # a failure with every model ready: dropped
    sent[:] = []
    asyncio.run(step.release(gens[4]))
    state.update(fail=False)
    asyncio.run(step.release(gens[0]))
    assert rows() == [[5], [1]]
