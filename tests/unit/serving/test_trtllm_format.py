"""spec_decode.serving.trtllm_format: generate_trtllm relays a [1, ...] request to generate over decoupled BLS (batch
dimension removed, exclude_input_in_output true when absent) and each response back with it added; errors pass through,
a cancelled client gets its final response at once and the inner request is cancelled where the backend can, and no
wait blocks the event loop. pb_utils and generate are fakes here; tests/integration/test_trtllm_format.py runs the real
ones."""

import asyncio
import json
import threading
import time

import numpy as np
import pytest

from spec_decode.serving import wire
from spec_decode.serving.trtllm_format import TrtllmFormatBackend, unbatch
from spec_decode.settings import InvalidInputError
from tests.fake_pb_utils import FINAL, FakePbUtils, InferenceRequest, InferenceResponse, Request, Tensor, TritonError


class _Responses:
    """generate's responses as the BLS iterator yields them; ``before(i)`` runs before the i-th is handed out (in the
    pool's thread, as the real blocking ``__next__``)."""

    def __init__(self, responses, before=None):
        self.items, self.before, self.read = list(responses), before, 0

    def __iter__(self):
        return self

    def __next__(self):
        if self.before is not None:
            self.before(self.read)
        if self.read >= len(self.items):
            raise StopIteration
        self.read += 1
        return self.items[self.read - 1]


class _Cancellable(_Responses):
    """An iterator of a Python backend that can cancel a BLS request (python_backend >= PR #398)."""

    cancels = 0

    def cancel(self):
        self.cancels += 1


class _Bls(InferenceRequest):
    """A decoupled BLS request: ``exec(decoupled=True)`` answers ``respond(self)`` (an iterator)."""

    sent: list = []

    def exec(self, decoupled=False):
        assert decoupled
        return type(self).respond(self)


class _Pb(FakePbUtils):
    InferenceRequest = _Bls


def _out(**outputs):
    return InferenceResponse([Tensor(name, value) for name, value in outputs.items()])


def _step(text, ids):
    return _out(text_output=np.array([text.encode()], object), output_ids=np.array(ids, np.int32))


def _final(text, ids, reason="length"):
    r = _step(text, ids)
    return InferenceResponse(r.output_tensors + [Tensor("finish_reason", np.array([reason.encode()], object)),
                                                 Tensor("num_output_tokens", np.array([len(ids)], np.uint32))])


def _request(**kw):
    """The frontend's request: every input [1, 1] (stop_words [1, n])."""
    base = dict(text_input=np.array([[b"def add(a, b):"]], object), max_tokens=np.array([[16]], np.int32),
                stream=np.array([[True]]), seed=np.array([[3]], np.uint64),
                stop_words=np.array([[b"\n\n", b"#"]], object), return_num_output_tokens=np.array([[True]]))
    base.update(kw)
    return Request(**base)


def _run(backend, *requests):
    async def go():
        await asyncio.gather(*(backend.handle(r) for r in requests))

    asyncio.run(go())


@pytest.fixture
def backend():
    _Bls.sent = []
    b = TrtllmFormatBackend(_Pb, poll_s=0.01)
    yield b
    b.close()


def test_a_request_goes_to_generate_without_its_batch_dimension_and_comes_back_with_it(backend):
    _Bls.respond = lambda req: _Responses([_step("    ", [1, 2]), _final("return a + b", [3, 4, 5])])
    req = _request()
    _run(backend, req)
    (inner,) = _Bls.sent
    assert inner.model == "generate" and inner.outputs == list(wire.GENERATE_OUTPUTS)
    assert inner.inputs["text_input"].tolist() == [b"def add(a, b):"] and inner.inputs["max_tokens"].tolist() == [16]
    assert inner.inputs["stop_words"].tolist() == [b"\n\n", b"#"] and inner.inputs["seed"].dtype == np.uint64
    assert inner.inputs["exclude_input_in_output"].tolist() == [True]  # absent: no echo (OpenAI's default)
    (first, f0), (last, f1) = req.sender.sent
    assert (f0, f1) == (0, FINAL)  # the response that carries finish_reason is the final one: no empty one after it
    assert first.outputs["text_output"].shape == (1, 1) and first.outputs["text_output"][0, 0] == b"    "
    assert first.outputs["output_ids"].tolist() == [[1, 2]] and "finish_reason" not in first.outputs
    assert last.outputs["finish_reason"].tolist() == [[b"length"]] and last.outputs["num_output_tokens"].shape == (1, 1)


def test_echo_is_passed_on_and_two_dimensional_outputs_get_a_third(backend):
    top = np.arange(6, dtype=np.float32).reshape(3, 2)
    _Bls.respond = lambda req: _Responses([InferenceResponse(
        _final("x", [1, 2, 3]).output_tensors + [Tensor("top_log_probs", top)])])
    req = _request(exclude_input_in_output=np.array([[False]]), stream=np.array([[False]]))
    _run(backend, req)
    assert _Bls.sent[0].inputs["exclude_input_in_output"].tolist() == [False]
    ((resp, flags),) = req.sender.sent
    assert flags == FINAL and resp.outputs["top_log_probs"].shape == (1, 3, 2)


@pytest.mark.parametrize("message, code", [("invalid input 'temperature': must be in [0, 100], got -1.0",
                                            "INVALID_ARG"),
                                           ("spec_step failed: Stub process 'verifier_0_0' is not healthy",
                                            "INTERNAL")])
def test_generate_s_error_comes_back_as_the_final_response(backend, message, code):
    responses = _Responses([InferenceResponse(error=TritonError(message))])
    _Bls.respond = lambda req: responses
    req = _request()
    _run(backend, req)
    ((resp, flags),) = req.sender.sent
    assert flags == FINAL and resp.error().message() == message and resp.error().code == code
    with pytest.raises(StopIteration):  # read to its end
        next(responses)


def test_bad_requests_are_refused_before_generate_is_called(backend):
    class WithParameters(Request):
        def parameters(self):
            return json.dumps({"top_kk": 3})

    bad_batch = _request(max_tokens=np.array([[16], [16]], np.int32))
    with_parameters = WithParameters(**_request().inputs)
    _run(backend, bad_batch, with_parameters)
    for req, field in ((bad_batch, "max_tokens"), (with_parameters, "top_kk")):
        ((resp, flags),) = req.sender.sent
        assert flags == FINAL and resp.error().code == "INVALID_ARG" and f"'{field}'" in resp.error().message()
    assert "accepted: " in with_parameters.sender.sent[0][0].error().message()
    assert _Bls.sent == []
    with pytest.raises(InvalidInputError, match=r"'text_input': expected a batch of one .*, got shape \[\]"):
        unbatch({"text_input": np.array(b"x", object)})


def test_a_failing_bls_call_is_an_internal_error_naming_generate(backend):
    def fail(req):
        raise RuntimeError("Failed to open the cudaIpcHandle")

    _Bls.respond = fail
    req = _request()
    _run(backend, req)
    ((resp, flags),) = req.sender.sent
    assert flags == FINAL and resp.error().code == "INTERNAL"
    assert resp.error().message() == "generate failed: Failed to open the cudaIpcHandle"


def test_generate_s_empty_final_response_ends_the_stream_without_data(backend):
    _Bls.respond = lambda req: _Responses([_step("a", [1]), InferenceResponse()])
    req = _request()
    _run(backend, req)
    assert [(r is None, f) for r, f in req.sender.sent] == [(False, 0), (True, FINAL)]


@pytest.mark.parametrize("iterator", [_Responses, _Cancellable])
def test_a_cancelled_client_gets_its_final_at_once_and_the_inner_request_is_cancelled_where_it_can(backend, iterator):
    req = _request()

    def before(i):  # the client leaves while generate computes the second response
        if i == 1:
            req.sender.cancelled = True
            time.sleep(0.1)

    responses = iterator([_step("a", [1]), _step("b", [2]), _step("c", [3]), _final("d", [4])], before)
    _Bls.respond = lambda r: responses
    _run(backend, req)
    assert [(r is None, f) for r, f in req.sender.sent] == [(False, 0), (True, FINAL)]  # nothing after the cancel
    assert responses.read == 4  # read to its end (Triton 2.51 cannot cancel a BLS request: generate runs on)
    if iterator is _Cancellable:
        assert responses.cancels == 1


def test_waits_run_in_the_pool_so_concurrent_requests_progress(backend):
    """Request a's generate answers only once request b has its final response: a wait on the event loop would
    deadlock (here: time out after 5 s)."""
    b_done = threading.Event()
    a, b = _request(), _request()
    b.sender.send = _notify(b.sender.send, b_done)

    def respond(inner):
        if len(_Bls.sent) == 1:
            return _Responses([_final("a", [1])], before=lambda i: b_done.wait(5) if i == 0 else None)
        return _Responses([_final("b", [2])])

    _Bls.respond = respond
    t0 = time.monotonic()
    _run(backend, a, b)
    assert time.monotonic() - t0 < 4 and b_done.is_set()
    assert a.sender.sent[0][0].outputs["text_output"].tolist() == [[b"a"]]


def _notify(send, event):
    def wrapped(response=None, flags=0):
        send(response, flags)
        if flags == FINAL:
            event.set()

    return wrapped
