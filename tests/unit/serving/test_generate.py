"""spec_decode.serving.generate: a request's life in the decoupled model with a fake pb_utils (cancellation, errors,
metrics), the steps scripted."""

import asyncio

import numpy as np
import pytest

from spec_decode.protocol import StepResult
from spec_decode.serving.metrics import METRICS
from tests.fake_pb_utils import FINAL, FakePbUtils, MetricFamily, Request, exported


class _ScriptedStep:
    """Each step emits two fixed tokens (one accepted draft of two); can cancel the client during step ``cancel_at``."""

    def __init__(self, request=None, cancel_at=None, fail_at=None):
        self.request, self.cancel_at, self.fail_at = request, cancel_at, fail_at
        self.calls, self.released = 0, []

    async def __call__(self, inp):
        self.calls += 1
        await asyncio.sleep(0)
        if self.calls == self.fail_at:
            raise RuntimeError("spec_step failed: boom")
        if self.calls == self.cancel_at:
            self.request.sender.cancelled = True
        return StepResult([40 + self.calls, 60 + self.calls], 2, [-0.5, -0.25])

    async def run_batch(self, inps):
        return [await self(i) for i in inps]

    async def release(self, gen):
        self.released.append(gen.seq_id)


@pytest.fixture(scope="module")
def backend(real_model_dir):
    from spec_decode.serving.generate import GenerateBackend

    return GenerateBackend({"draft_model_available": "false"}, FakePbUtils)


def _request(**kw):
    base = dict(text_input=np.array([b"def add(a, b):"], object), max_tokens=np.array([50], np.int32),
                stream=np.array([True]), speculative_method=np.array([b"ngram"], object))
    base.update(kw)
    return Request(**base)


def test_cancel_during_a_step_stops_within_it_and_frees_the_sequence(backend):
    req = _request()
    backend.step = _ScriptedStep(req, cancel_at=3)
    before = backend.metrics.get("spec_decode_requests_total", method="ngram", finish_reason="cancelled")
    asyncio.run(backend.handle(req))
    assert backend.step.calls == 3  # the step in flight finished; no step after it
    sent = req.sender.sent
    assert [f for _, f in sent] == [0, 0, FINAL] and sent[-1][0] is None  # 2 streamed steps, then an empty final
    assert [list(r.outputs["output_ids"]) for r, _ in sent[:2]] == [[41, 61], [42, 62]]
    assert len(backend.step.released) == 1
    assert backend.metrics.get("spec_decode_requests_total", method="ngram", finish_reason="cancelled") == before + 1
    assert backend.metrics.get("spec_decode_running_sequences") == 0


def test_failing_step_sends_one_error_and_releases(backend):
    req = _request()
    backend.step = _ScriptedStep(fail_at=2)
    asyncio.run(backend.handle(req))
    (first, f0), (last, f1) = req.sender.sent
    assert f0 == 0 and f1 == FINAL and "boom" in last.error().message() and last.error().code == "INTERNAL"
    assert len(backend.step.released) == 1
    assert backend.metrics.get("spec_decode_requests_total", method="ngram", finish_reason="error") >= 1


def test_bad_input_is_an_invalid_arg_response_and_starts_nothing(backend):
    req = _request(num_draft_tokens=np.array([99], np.int32))
    backend.step = _ScriptedStep()
    asyncio.run(backend.handle(req))
    ((resp, flags),) = req.sender.sent
    err = resp.error()
    assert flags == FINAL and err.code == "INVALID_ARG" and "num_draft_tokens" in err.message()
    assert "[0, 8]" in err.message() and backend.step.calls == 0 and backend.step.released == []


def test_metrics_count_committed_tokens_and_export_them(backend):
    m = backend.metrics
    names = ("spec_decode_steps_total", "spec_decode_draft_tokens_total", "spec_decode_accepted_tokens_total",
             "spec_decode_emitted_tokens_total")
    before = [m.get(n, method="ngram") for n in names]
    req = _request(max_tokens=np.array([5], np.int32), stream=np.array([False]))
    backend.step = _ScriptedStep()
    asyncio.run(backend.handle(req))
    ((resp, flags),) = req.sender.sent  # stream=false: one response
    assert flags == FINAL and list(resp.outputs["output_ids"]) == [41, 61, 42, 62, 43]
    # 3 steps, 2 drafts each, 1 accepted + 1 more token each; max_tokens=5 cuts the third step's last token
    assert [m.get(n, method="ngram") - b for n, b in zip(names, before)] == [3, 6, 3, 5]
    assert int(resp.outputs["num_accepted_tokens"][0]) == 3 and int(resp.outputs["num_emitted_tokens"][0]) == 5
    steps, drafted, accepted, emitted = (m.get(n, method="ngram") for n in names)
    assert m.get("spec_decode_acceptance_rate", method="ngram") == pytest.approx(accepted / drafted)
    assert m.get("spec_decode_mean_accepted_length", method="ngram") == pytest.approx(emitted / steps)
    # what went to pb_utils.MetricFamily is what the process holds
    assert exported()[("spec_decode_emitted_tokens_total", (("method", "ngram"),))] == emitted
    assert {f.name for f in MetricFamily.created} <= set(METRICS)


@pytest.mark.parametrize("stream", [True, False])
def test_usage_outputs_count_the_prompt_and_each_response_s_tokens(backend, stream):
    """return_num_input_tokens / return_num_output_tokens (the vLLM backend's, read by NVIDIA's OpenAI frontend): every
    response carries the prompt's token count and its own tokens', so a stream's sum to the completion's."""
    flags = dict(return_num_input_tokens=np.array([True]), return_num_output_tokens=np.array([True]))
    req = _request(max_tokens=np.array([5], np.int32), stream=np.array([stream]), **flags)
    backend.step = _ScriptedStep()
    asyncio.run(backend.handle(req))
    responses = [r for r, _ in req.sender.sent]
    assert len(responses) == (3 if stream else 1) and req.sender.sent[-1][1] == FINAL
    prompt_len = len(backend.tokenizer("def add(a, b):")["input_ids"])
    for r in responses:
        n_in, n_out = r.outputs["num_input_tokens"], r.outputs["num_output_tokens"]
        assert n_in.dtype == n_out.dtype == np.uint32 and n_in.tolist() == [prompt_len]
        assert n_out.tolist() == [len(r.outputs["output_ids"])]
    assert sum(int(r.outputs["num_output_tokens"][0]) for r in responses) == 5
    assert int(responses[-1].outputs["num_emitted_tokens"][0]) == 5

    req = _request(max_tokens=np.array([3], np.int32), stream=np.array([stream]))  # not asked for: not sent
    asyncio.run(backend.handle(req))
    assert all("num_input_tokens" not in r.outputs and "num_output_tokens" not in r.outputs for r, _ in req.sender.sent)


def test_generate_is_held_to_draft_model_s_config_when_it_can_read_it(real_model_dir):
    """generate's largest k may not pass draft_model's, and draft_model_available follows draft_model_path."""
    from spec_decode.serving.generate import GenerateBackend

    with pytest.raises(ValueError, match="'max_num_draft_tokens': 32 is above draft_model's max_num_draft_tokens=16"):
        GenerateBackend({"max_num_draft_tokens": "32"}, FakePbUtils, {"draft_model_path": ""})
    with pytest.raises(ValueError, match="'draft_model_available': 'true', but draft_model's draft_model_path ''"):
        GenerateBackend({"draft_model_available": "true"}, FakePbUtils, {"draft_model_path": ""})
    with_lm = GenerateBackend({}, FakePbUtils, {"draft_model_path": "default", "max_num_draft_tokens": "8"})
    assert "draft" in with_lm.limits.methods
    without = GenerateBackend({}, FakePbUtils, {"draft_model_path": "", "max_num_draft_tokens": "8"})
    assert "draft" not in without.limits.methods


def test_sibling_parameters_reads_the_shipped_draft_model_config():
    from spec_decode.launcher import DEFAULT_REPOSITORY
    from spec_decode.serving.adapter import sibling_parameters

    params = sibling_parameters({"model_repository": str(DEFAULT_REPOSITORY / "generate")}, "draft_model")
    assert params["max_num_draft_tokens"] == "16" and params["draft_model_path"] == "auto"
    assert sibling_parameters({"model_repository": str(DEFAULT_REPOSITORY / "generate")}, "no_such_model") is None


def test_end_ids_are_the_tokenizer_s_and_every_one_of_generation_config(tmp_path):
    import json
    from types import SimpleNamespace

    from spec_decode.serving.generate import end_token_ids

    tok = SimpleNamespace(eos_token_id=2)
    assert end_token_ids(tok, tmp_path) == {2}  # no generation_config.json
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [128001, 128008, 128009]}))
    assert end_token_ids(tok, tmp_path) == {2, 128001, 128008, 128009}
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": 7}))
    assert end_token_ids(SimpleNamespace(eos_token_id=None), tmp_path) == {7}
