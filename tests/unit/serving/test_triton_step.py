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
    plain = StepInputs(1, [3, 4], 0, "suffix", SamplingParams(), 0)
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
