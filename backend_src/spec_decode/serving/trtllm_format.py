"""Backend of the decoupled ``generate_trtllm`` model: ``generate`` in the request format of NVIDIA's OpenAI frontend.

NVIDIA's OpenAI-compatible frontend for Triton (triton-inference-server/server, ``python/openai/openai_frontend/
engine/utils/triton.py``, ``_create_trtllm_generate_request``) drives every model whose backend is not vllm with the
TensorRT-LLM backend's inputs, each with a leading batch dimension: ``text_input`` [[prompt]], ``max_tokens``,
``stream``, ``top_p``, ``temperature``, ``presence_penalty``, ``frequency_penalty``, ``seed`` [1, 1], ``stop_words``
[1, n], the guided-decoding pair and ``return_num_input_tokens`` / ``return_num_output_tokens``. Those [1, 1] shapes
need a model with ``max_batch_size`` >= 1, while ``generate`` has 0 (dims [1], which its clients send).
``generate_trtllm`` declares generate's tensors per row (:data:`.wire.MODELS`) with ``max_batch_size`` 1 and relays each
request to ``generate`` as a decoupled BLS request, the batch dimension removed, and each of generate's responses back
with it added (``text_output`` [1, 1]: the frontend reads exactly one string). Errors come back as error responses (the
message kept; INVALID_ARG when it names an input, as generate's). docs/triton-openai-frontend.md is the user's side.

``exclude_input_in_output`` defaults to **true** here (generate's default is false): the frontend sends it only when
the OpenAI request sets ``echo``, and OpenAI's completions return only the new text unless ``echo`` is true; chat
completions never send it and must not repeat the prompt (the chat template) as the assistant's message.

Cancellation: when this model's response sender is cancelled (the frontend cancels an abandoned request), the empty
final response is sent at once and the inner request is cancelled through the BLS response iterator's ``cancel()``
where the Python backend has it (python_backend PR #398, merged in April 2025, after r24.10). Triton 2.51 (the
embedded tritonserver, python_backend r24.10) has none: its ``ResponseIterator`` offers only ``__iter__`` and
``__next__``, and a BLS request cannot be cancelled, so ``generate`` runs that request on to its end (``max_tokens`` at
most) while its responses are read and dropped. In r24.10 ``__next__`` blocks (releasing the GIL), and an iterator
dropped before its final response blocks in its destructor until that response, so every wait runs in a thread of
this backend's pool, never on the event loop, and each iterator is read to its end.
"""

from __future__ import annotations

import asyncio
import logging
import traceback
from concurrent.futures import ThreadPoolExecutor
from functools import partial

import numpy as np

from ..settings import InvalidInputError
from .adapter import read_inputs, request_parameters, to_pb_tensor
from .wire import GENERATE, GENERATE_INPUTS, GENERATE_OUTPUTS, GENERATE_TRTLLM

logger = logging.getLogger(__name__)

MAX_WAITING_THREADS = 128  # requests waiting on generate at once (more wait for a thread, none is refused)
CANCEL_POLL_S = 0.1  # how often a request waiting on generate looks whether its client cancelled it
_FINAL_OUTPUT = "finish_reason"  # generate sends it in its final response only (docs/client.md)


def unbatch(inputs: dict) -> dict:
    """Inputs of a ``generate_trtllm`` request without their batch dimension: [1, *dims] -> [*dims].

    Args:
        inputs: input name -> numpy array (or torch tensor) with a leading batch dimension of 1.

    Returns:
        input name -> the array's one row.

    Raises:
        InvalidInputError: an input whose batch dimension is not 1 (naming it).
    """
    out = {}
    for name, value in inputs.items():
        if value.ndim == 0 or value.shape[0] != 1:
            raise InvalidInputError(name, f"expected a batch of one ([1, ...]), got shape {list(value.shape)}")
        out[name] = value[0]
    return out


def refuse_parameters(parameters: dict) -> None:
    """Refuse request parameters, as generate does (a JSON key over HTTP that names no input becomes one).

    Raises:
        InvalidInputError: naming the first unknown key and listing the accepted inputs.
    """
    for key in sorted(parameters):
        raise InvalidInputError(key, f"unknown input of {GENERATE_TRTLLM}; accepted: "
                                     f"{', '.join(sorted(GENERATE_INPUTS))}")


def _next(iterator):
    """The iterator's next response, or None at its end (a blocking call: run in a pool thread)."""
    try:
        return next(iterator)
    except StopIteration:
        return None


class TrtllmFormatBackend:
    """The ``generate_trtllm`` model's logic (module docstring): each request relayed to ``generate`` over BLS.

    Args:
        pb_utils: the ``triton_python_backend_utils`` module.
        model_name: the model the requests go to.
        max_threads: the pool's threads: requests that can wait on ``generate`` at once (each wait holds one).
        poll_s: seconds between two looks at a waiting request's cancellation.
    """

    def __init__(self, pb_utils, model_name: str = GENERATE, max_threads: int = MAX_WAITING_THREADS,
                 poll_s: float = CANCEL_POLL_S):
        self.pb = pb_utils
        self.model_name = model_name
        self.poll_s = poll_s
        self.pool = ThreadPoolExecutor(max_threads, thread_name_prefix="generate_trtllm")

    def inner_request(self, request):
        """The decoupled BLS request to ``generate`` for one request of ``generate_trtllm``: its inputs without the
        batch dimension, ``exclude_input_in_output`` true when absent, every output of generate requested.

        Raises:
            InvalidInputError: a request parameter, or an input whose batch dimension is not 1.
        """
        refuse_parameters(request_parameters(request))
        inputs = unbatch(read_inputs(request, GENERATE_INPUTS, self.pb))
        inputs.setdefault("exclude_input_in_output", np.array([True]))
        tensors = [to_pb_tensor(name, value, self.pb) for name, value in inputs.items()]
        return self.pb.InferenceRequest(model_name=self.model_name, inputs=tensors,
                                        requested_output_names=list(GENERATE_OUTPUTS))

    def _error(self, message: str):
        pb = self.pb
        code = pb.TritonError.INVALID_ARG if message.startswith("invalid input '") else pb.TritonError.INTERNAL
        return pb.InferenceResponse(error=pb.TritonError(message, code))

    def relayed(self, response):
        """One of generate's responses as ``generate_trtllm`` sends it, and whether it is the final one.

        Returns:
            (response, final): an error response (final); None for an empty response (generate's final one after a
            cancellation: final); else every output with the batch dimension added ([n] -> [1, n]), final when it
            carries ``finish_reason``.
        """
        pb = self.pb
        if response.has_error():
            return self._error(response.error().message()), True
        out = {}
        for name in GENERATE_OUTPUTS:
            t = pb.get_output_tensor_by_name(response, name)
            if t is not None:
                out[name] = pb.Tensor(name, np.expand_dims(t.as_numpy(), 0))
        if not out:
            return None, True
        return pb.InferenceResponse(output_tensors=list(out.values())), _FINAL_OUTPUT in out

    async def handle(self, request) -> None:
        """Relay one request to completion: generate's responses go through the request's response sender, the last
        with the FINAL flag; after a cancellation only an empty final response. Never raises."""
        relay = _Relay(self, request.get_response_sender())
        try:
            inner = self.inner_request(request)
        except Exception as exc:  # noqa: BLE001
            relay.finish(self._error(str(exc)))
            return
        iterator = None
        try:
            iterator = await relay.wait(partial(inner.exec, decoupled=True), None)
            while (response := await relay.wait(partial(_next, iterator), iterator)) is not None:
                if not relay.done:
                    relay.send(*self.relayed(response))
            iterator = None  # read to its end
        except Exception as exc:  # noqa: BLE001
            logger.error("generate_trtllm: %s", traceback.format_exc())
            relay.finish(self._error(f"{self.model_name} failed: {exc}"))
        finally:
            relay.finish()
            if iterator is not None:  # an error midway: read the rest off the event loop (module docstring)
                try:
                    await asyncio.get_running_loop().run_in_executor(self.pool, _drain, iterator)
                except Exception:  # noqa: BLE001 - nothing more to tell the client
                    logger.warning("generate_trtllm: reading the rest of a failed request: %s", traceback.format_exc())

    def close(self) -> None:
        """Stop the pool (at the model's ``finalize``), without waiting for its threads."""
        self.pool.shutdown(wait=False, cancel_futures=True)


def _drain(iterator) -> None:
    while _next(iterator) is not None:
        pass


class _Relay:
    """One request's side of the relay: its sender, whether its final response is sent, its cancellation."""

    def __init__(self, backend: TrtllmFormatBackend, sender):
        self.backend, self.sender = backend, sender
        self.final = backend.pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL
        self.done = False  # the final response is sent
        self.cancelled = False  # the client cancelled; the inner request is cancelled where the backend can
        self._inner_cancelled = False

    def send(self, response, final: bool) -> None:
        """Send ``response`` (None: only the flag), FINAL when ``final``; nothing once the final one is sent."""
        if self.done:
            return
        self.done = final
        try:
            if response is None:
                self.sender.send(flags=self.final)
            else:
                self.sender.send(response, flags=self.final if final else 0)
        except Exception:  # noqa: BLE001 - the client's stream may already be closed
            logger.warning("generate_trtllm: sending a response failed: %s", traceback.format_exc())

    def finish(self, response=None) -> None:
        """Send the final response (``response``, or only the flag) unless it is sent."""
        self.send(response, True)

    async def wait(self, fn, iterator):
        """``fn()`` run in the backend's pool, looking every ``poll_s`` seconds whether the client cancelled: then the
        empty final response goes at once and ``iterator`` (the inner request's responses) is cancelled where the
        Python backend can.

        Raises:
            Exception: what ``fn`` raised.
        """
        backend = self.backend
        fut = asyncio.get_running_loop().run_in_executor(backend.pool, fn)
        while True:
            done, _ = await asyncio.wait({fut}, timeout=backend.poll_s)
            if not self.cancelled and not self.done and self.sender.is_cancelled():
                self.cancelled = True
                self.finish()
            if self.cancelled and iterator is not None and not self._inner_cancelled:
                self._inner_cancelled = True
                cancel = getattr(iterator, "cancel", None)  # not in Triton 2.51's Python backend (module docstring)
                if cancel is not None:
                    try:
                        cancel()
                    except Exception:  # noqa: BLE001 - generate then runs on to its end, as without cancel()
                        logger.warning("generate_trtllm: cancelling generate's request failed: %s",
                                       traceback.format_exc())
            if done:
                return fut.result()
