"""generate's request handling with a fake pb_utils (cancellation, errors, metrics), the metrics module, and the
sampling transforms shared by the draft and the target."""

import asyncio

import numpy as np
import pytest
import torch

from spec_decode.kv_cache import CachedCausalLM
from spec_decode.loop import Generation, LocalStep, StepResult, run_local
from spec_decode.proposers import DraftModelProposer, SuffixProposer
from spec_decode.request import GenerationRequest
from spec_decode.sampling import SamplingParams
from spec_decode.scorer import TargetScorer
from spec_decode.serving.metrics import METRICS, Metrics

FINAL = 1


class _Tensor:
    def __init__(self, name, arr):
        self.name, self.arr = name, np.asarray(arr)

    def is_cpu(self):
        return True

    def as_numpy(self):
        return self.arr


class _Response:
    def __init__(self, output_tensors=None, error=None):
        self.outputs = {t.name: t.arr for t in output_tensors or []}
        self.error = error


class _Error:
    INVALID_ARG, INTERNAL = "INVALID_ARG", "INTERNAL"

    def __init__(self, message, code):
        self.message, self.code = message, code


class _FakeMetricFamily:
    COUNTER, GAUGE = "counter", "gauge"
    created = []

    def __init__(self, name, description, kind):
        self.name, self.kind, self.metrics = name, kind, []
        _FakeMetricFamily.created.append(self)

    def Metric(self, labels):  # noqa: N802 - pb_utils' name
        m = _FakeMetric(labels)
        self.metrics.append(m)
        return m


class _FakeMetric:
    def __init__(self, labels):
        self.labels, self.value = labels, 0.0

    def increment(self, v):
        self.value += v

    def set(self, v):
        self.value = v


class FakePb:
    """The parts of triton_python_backend_utils that generate uses."""

    TRITONSERVER_RESPONSE_COMPLETE_FINAL = FINAL
    Tensor, InferenceResponse, TritonError, MetricFamily = _Tensor, _Response, _Error, _FakeMetricFamily

    @staticmethod
    def get_input_tensor_by_name(request, name):
        arr = request.inputs.get(name)
        return None if arr is None else _Tensor(name, arr)

    @staticmethod
    def get_output_tensor_by_name(response, name):
        return _Tensor(name, response.outputs[name])


class _Sender:
    def __init__(self):
        self.sent, self.cancelled = [], False

    def send(self, response=None, flags=0):
        assert not (self.sent and self.sent[-1][1] == FINAL), "a response was sent after the final one"
        self.sent.append((response, flags))

    def is_cancelled(self):
        return self.cancelled


class _Request:
    def __init__(self, **inputs):
        self.inputs, self.sender = inputs, _Sender()

    def get_response_sender(self):
        return self.sender


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

    async def release(self, gen):
        self.released.append(gen.seq_id)


@pytest.fixture(scope="module")
def backend(real_model_dir):
    from spec_decode.serving.generate import GenerateBackend

    return GenerateBackend({"draft_model_available": "false"}, FakePb)


def _request(**kw):
    base = dict(text_input=np.array([b"def add(a, b):"], object), max_tokens=np.array([50], np.int32),
                stream=np.array([True]), speculative_method=np.array([b"ngram"], object))
    base.update(kw)
    return _Request(**base)


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
    assert f0 == 0 and f1 == FINAL and "boom" in last.error.message and last.error.code == "INTERNAL"
    assert len(backend.step.released) == 1
    assert backend.metrics.get("spec_decode_requests_total", method="ngram", finish_reason="error") >= 1


def test_bad_input_is_an_invalid_arg_response_and_starts_nothing(backend):
    req = _request(num_draft_tokens=np.array([99], np.int32))
    backend.step = _ScriptedStep()
    asyncio.run(backend.handle(req))
    ((resp, flags),) = req.sender.sent
    assert flags == FINAL and resp.error.code == "INVALID_ARG" and "num_draft_tokens" in resp.error.message
    assert "[0, 8]" in resp.error.message and backend.step.calls == 0 and backend.step.released == []


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
    exported = {(f.name, tuple(sorted(x.labels.items()))): x.value
                for f in _FakeMetricFamily.created for x in f.metrics}
    assert exported[("spec_decode_emitted_tokens_total", (("method", "ngram"),))] == emitted
    assert {f.name for f in _FakeMetricFamily.created} <= set(METRICS)


def test_metrics_reject_unknown_names_and_decreasing_counters():
    m = Metrics()
    with pytest.raises(KeyError):
        m.add("no_such_metric", 1)
    with pytest.raises(ValueError, match="cannot decrease"):
        m.add("spec_decode_steps_total", -1, method="none")
    with pytest.raises(ValueError, match="counter"):
        m.set("spec_decode_steps_total", 3, method="none")


def test_system_efficiency_counts_k_plus_one_per_step():
    from spec_decode.loop import GenerationStats

    m = Metrics()
    after = GenerationStats(steps=1, draft_tokens=4, accepted_tokens=1, emitted_tokens=2)
    m.record_step("draft", 4, (0, 0, 0, 0), after)
    assert m.get("spec_decode_system_efficiency", method="draft") == pytest.approx(2 / 5)
    assert m.get("spec_decode_acceptance_rate", method="draft") == pytest.approx(1 / 4)


def test_draft_and_target_apply_the_same_sampling_transforms(tiny_lm):
    """Self-draft under temperature, top-k and top-p: the draft's rows are the target's, so every draft is accepted."""
    params = SamplingParams(temperature=0.7, top_k=20, top_p=0.9, seed=3)
    prompt = [5, 17, 3, 9]
    draft = DraftModelProposer(CachedCausalLM(tiny_lm))
    scorer = TargetScorer(CachedCausalLM(tiny_lm))
    proposal = draft.propose(1, prompt, 4, params, 0)
    target = scorer.score(1, prompt, proposal.draft_token_ids.tolist(), params)
    assert torch.equal(proposal.draft_probs > 0, target[:4] > 0)  # same top-k/top-p support
    torch.testing.assert_close(proposal.draft_probs, target[:4], atol=1e-5, rtol=1e-4)

    step = LocalStep({"draft": draft}, scorer)
    req = GenerationRequest("x", 24, temperature=0.7, top_k=20, top_p=0.9, random_seed=3, speculative_method="draft")
    gen = Generation(2, prompt, req, _Tok(), [], 256, 3)
    run_local(gen, step)
    assert gen.stats.accepted_tokens == gen.stats.draft_tokens > 0


def test_seeded_sampling_skips_the_global_suffix_tree():
    """A seeded sampled request drafts from itself only (reproducible whatever ran before); greedy and unseeded use
    earlier responses."""
    p = SuffixProposer(backend="python")
    earlier = [1, 2, 3, 4, 5, 6, 7, 8]
    p.speculate(1, earlier[:2], 4)
    p.update(1, earlier)
    p.release(1)  # the response 3..8 is now in the global tree
    ctx = [9, 3, 4, 5]
    greedy, seeded, unseeded = SamplingParams(), SamplingParams(0.8, seed=1), SamplingParams(0.8, seed=1, seeded=False)
    assert p.propose(2, ctx, 3, greedy, 0).draft_token_ids.tolist() == [6, 7, 8]
    assert p.propose(3, ctx, 3, unseeded, 0).draft_token_ids.tolist() == [6, 7, 8]
    assert p.propose(4, ctx, 3, seeded, 0).draft_token_ids.tolist() == []


class _Tok:
    def decode(self, ids, **kw):
        return "".join(chr(ord("a") + t % 26) for t in ids)


def test_target_and_draft_backends_batch_requests_and_isolate_errors(tiny_lm, tmp_path):
    """run_batch (what execute() gets from Triton's dynamic batcher): one forward for several sequences, results equal
    to running each alone, a bad request fails alone, a release is answered in the same batch."""
    from spec_decode.serving.step_models import DraftBackend, TargetBackend

    tiny_lm.save_pretrained(tmp_path / "tiny")
    params = {"model_path": str(tmp_path / "tiny"), "device": "cpu", "dtype": "float32"}

    def req(seq, ids, drafts=(), **kw):
        base = {"sequence_id": np.array([seq], np.uint64), "token_ids": np.array(ids, np.int64),
                "draft_token_ids": np.array(drafts, np.int64), "temperature": np.array([0.0], np.float32),
                "top_k": np.array([0], np.int32), "top_p": np.array([1.0], np.float32), "release": np.array([False])}
        base.update({k: np.array([v]) for k, v in kw.items()})
        return base

    alone = TargetBackend(params)
    expected = [alone.run(req(1, [5, 6, 7], [8, 9]))["target_probs"], alone.run(req(2, [1, 2], [3]))["target_probs"]]
    batched = TargetBackend(params)
    calls = []
    score_batch = batched.scorer.score_batch
    batched.scorer.score_batch = lambda items: calls.append(len(items)) or score_batch(items)
    out = batched.run_batch([req(1, [5, 6, 7], [8, 9]), req(2, [1, 2], [3]), req(3, [1, 500]),
                             req(4, [1], release=True)])
    assert calls == [2]
    for got, want in zip(out[:2], expected):
        torch.testing.assert_close(got["target_probs"], want, atol=1e-5, rtol=1e-4)
    assert isinstance(out[2], ValueError) and "token ids" in str(out[2])
    assert out[3]["target_probs"].shape == (0, 0)

    draft = DraftBackend({"draft_model_path": str(tmp_path / "tiny"), "device": "cpu", "dtype": "float32"})
    step = {"num_draft_tokens": np.array([3], np.int32), "speculative_method": np.array([b"draft"], object),
            "random_seed": np.array([0], np.int64), "step": np.array([0], np.int64)}
    out = draft.run_batch([{**req(1, [5, 6, 7]), **step}, {**req(2, [1, 2]), **step},
                           {**req(5, [1, 2]), **step, "num_draft_tokens": np.array([99], np.int32)}])
    for o, ids in zip(out[:2], ([5, 6, 7], [1, 2])):
        with torch.inference_mode():
            full = tiny_lm.generate(torch.tensor([ids]), max_new_tokens=3, do_sample=False, eos_token_id=None,
                                    pad_token_id=0)[0, len(ids):].tolist()
        assert o["draft_token_ids"].tolist() == full and o["draft_probs"].shape == (3, 97)
    assert isinstance(out[2], ValueError) and "num_draft_tokens" in str(out[2])


def test_tiny_temperature_is_the_argmax_limit_not_nan():
    from spec_decode.sampling import logits_to_probs

    logits = torch.tensor([[1.0, 3.0, 2.5, -1e4], [0.0, 0.0, -5.0, 7.0]])
    for t in (1e-37, 1e-45, 1e-3):
        probs = logits_to_probs(logits, SamplingParams(temperature=t, top_k=3))
        assert torch.isfinite(probs).all()
        torch.testing.assert_close(probs, torch.tensor([[0.0, 1.0, 0.0, 0.0], [0.0, 0.0, 0.0, 1.0]]))
    torch.testing.assert_close(logits_to_probs(logits, SamplingParams(temperature=0.7)),
                               torch.softmax(logits / 0.7, -1))


def test_metrics_export_at_most_once_per_interval_and_on_flush(monkeypatch):
    """Writes to Triton (a round trip to the server process each) are batched: during a stream at most one export per
    interval, and everything changed is exported on flush (the end of a sequence), counters by their increments."""
    from spec_decode.serving import metrics as metrics_module

    now = [100.0]
    monkeypatch.setattr(metrics_module.time, "monotonic", lambda: now[0])
    m = Metrics(FakePb, export_interval_s=0.5)
    m.add("spec_decode_steps_total", 1, method="none")  # the first write exports at once
    assert m.exports == 1
    for _ in range(50):  # a stream's steps within the interval: kept in the process only
        m.add("spec_decode_steps_total", 1, method="none")
        m.set("spec_decode_target_kv_cache_tokens", 7)
    assert m.exports == 1 and m.get("spec_decode_steps_total", method="none") == 51
    now[0] += 0.6  # the interval has passed: the next write exports both changed series
    m.add("spec_decode_steps_total", 1, method="none")
    assert m.exports == 3
    m.add("spec_decode_steps_total", 2, method="none")
    m.set("spec_decode_target_kv_cache_tokens", 7)  # unchanged since the last export: nothing to send
    m.flush()
    exported = {(f.name, tuple(sorted(x.labels.items()))): x.value for f in _FakeMetricFamily.created for x in f.metrics
                if f in m._families.values()}
    assert exported[("spec_decode_steps_total", (("method", "none"),))] == 54
    assert exported[("spec_decode_target_kv_cache_tokens", ())] == 7
    assert m.exports == 4


def test_rounds_without_drafts_skip_draft_model():
    """generate's transport: a round in which no sequence drafts goes to score_step (target_model -> verifier, empty
    drafts); a round with one drafting sequence, and every release, goes through spec_step."""
    from spec_decode.loop import StepInputs
    from spec_decode.serving.generate import TritonStep

    sent = []

    class _Req:
        def __init__(self, model_name, inputs, requested_output_names):
            self.model, self.inputs, self.outputs = model_name, {t.name: t.arr for t in inputs}, requested_output_names
            sent.append(self)

        async def async_exec(self):
            b = len(self.inputs["sequence_id"])
            out = [_Tensor("output_ids", np.full((b, 1), 7)), _Tensor("output_log_probs", np.zeros((b, 1)))]
            if "draft_token_ids" in self.outputs:
                out.append(_Tensor("draft_token_ids", np.full((b, 2), -1)))
            return _ExecResponse(out)

    class _ExecResponse(_Response):
        def has_error(self):
            return False

    class _Pb(FakePb):
        InferenceRequest = _Req

        @staticmethod
        def get_output_tensor_by_name(response, name):  # None for an output the response lacks, as pb_utils
            return _Tensor(name, response.outputs[name]) if name in response.outputs else None

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
    gen = Generation(9, [3, 4], GenerationRequest("x", 4, speculative_method="none"), _Tok(), [], 256, 1)
    asyncio.run(step.release(gen))
    assert sent[-1].model == "spec_step" and bool(sent[-1].inputs["release"].all())


def test_a_release_that_fails_during_a_reload_is_sent_again_after_the_next_one():
    """While a model of the ensemble reloads, releases fail and the other models keep the caches: such a release is
    kept and sent again, in chunks of the ensemble's batch size, after the next release that succeeds. A release that
    fails while every model is ready (bad input) is dropped, so it cannot block later ones."""
    from spec_decode.serving.generate import TritonStep

    sent, state = [], {"fail": True, "ready": False}

    class _Req:
        def __init__(self, model_name, inputs, requested_output_names):
            self.inputs = {t.name: t.arr for t in inputs}
            sent.append(self)

        async def async_exec(self):
            return _ReleaseResponse()

    class _ReleaseResponse:
        def has_error(self):
            return state["fail"]

        def error(self):
            return _Error("Model 'spec_step' is not ready.", _Error.INTERNAL)

    class _Pb(FakePb):
        InferenceRequest = _Req

        @staticmethod
        def is_model_ready(name):
            return state["ready"]

    rows = lambda: [r.inputs["sequence_id"].ravel().tolist() for r in sent]  # noqa: E731
    step = TritonStep(_Pb, max_batch_size=2)
    gens = [Generation(i, [3, 4], GenerationRequest("x", 4, speculative_method="none"), _Tok(), [], 256, 1)
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
