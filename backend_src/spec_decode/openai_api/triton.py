"""The OpenAI server's client of Triton: one ``generate`` request per OpenAI request, over gRPC streaming, as any
tritonclient user sends it (``tritonclient.grpc.aio``; docs/client.md is the contract).

Each request is one bidirectional ``ModelStreamInfer`` stream carrying one ``generate`` request with ``stream=true``:
every response is one step's accepted tokens (:class:`StepOutput`), and the one that carries ``finish_reason`` is the
last. Closing the stream early (the HTTP client left) cancels the gRPC call, which Triton turns into a cancellation of
the request: ``generate`` stops stepping and frees the sequence's caches (docs/client.md, "Cancellation").
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass

import numpy as np

from .errors import OpenAIError, from_triton

MODEL = "generate"
# Triton's messages when the model cannot take the request now (not loaded, being healed, server starting or stopping)
_UNAVAILABLE = ("not ready", "unknown model", "not healthy", "is not found", "unavailable", "failed to connect",
                "connection refused", "socket closed", "shutting down")


@dataclass
class StepOutput:
    """One ``generate`` response: a step's accepted tokens.

    Attributes:
        text: the step's text (UTF-8 pieces completed so far; a stop word cut off).
        token_ids: the step's token ids.
        log_probs: each token's log-probability under the target, float, or None when not asked for.
        top_ids: [tokens, top] int32 ids of the most likely alternatives per token, or None.
        top_log_probs: [tokens, top] float32 their log-probabilities, or None.
        finish_reason: None, or on the last response "stop" / "length" (generate's finish reasons).
        num_input_tokens: the prompt's token count (every response), or None.
    """

    text: str
    token_ids: list[int]
    log_probs: list[float] | None = None
    top_ids: np.ndarray | None = None
    top_log_probs: np.ndarray | None = None
    finish_reason: str | None = None
    num_input_tokens: int | None = None


def _unavailable(message: str) -> bool:
    low = message.lower()
    return any(s in low for s in _UNAVAILABLE)


def parse_result(result) -> StepOutput:
    """A ``tritonclient.grpc.InferResult`` of ``generate`` as a :class:`StepOutput` (absent outputs: None)."""
    def arr(name):
        return result.as_numpy(name)

    text = arr("text_output")
    ids = arr("output_ids")
    lps = arr("output_log_probs")
    finish = arr("finish_reason")
    n_in = arr("num_input_tokens")
    return StepOutput(
        text=b"".join(np.asarray(text, object).reshape(-1)).decode("utf-8", "replace") if text is not None else "",
        token_ids=[int(t) for t in ids.reshape(-1)] if ids is not None else [],
        log_probs=[float(x) for x in lps.reshape(-1)] if lps is not None else None,
        top_ids=arr("top_log_prob_ids"),
        top_log_probs=arr("top_log_probs"),
        finish_reason=(finish.reshape(-1)[0].decode() or None) if finish is not None else None,
        num_input_tokens=int(n_in.reshape(-1)[0]) if n_in is not None else None,
    )


class TritonGenerate:
    """``generate`` behind Triton's gRPC endpoint, for one event loop (the client is made on first use, in the loop
    that uses it).

    Args:
        url: Triton's gRPC endpoint, ``host:port``.
        model: the decoupled model to call (``generate``).
    """

    def __init__(self, url: str, model: str = MODEL):
        self.url = url
        self.model = model
        self._client = None
        self._max_model_len: int | None = None

    def _get(self):
        if self._client is None:
            import tritonclient.grpc.aio as grpcclient

            self._client = grpcclient.InferenceServerClient(self.url)
        return self._client

    async def close(self) -> None:
        """Close the gRPC channel."""
        if self._client is not None:
            await self._client.close()
            self._client = None

    async def ready(self) -> bool:
        """Whether Triton answers and ``generate`` is READY (False on any error)."""
        try:
            return bool(await self._get().is_model_ready(self.model))
        except Exception:  # noqa: BLE001 - not up, not reachable: not ready
            return False

    async def max_model_len(self) -> int:
        """``generate``'s ``max_model_len`` parameter (its config; read once).

        Raises:
            OpenAIError: 503 when Triton cannot be asked.
        """
        if self._max_model_len is None:
            try:
                cfg = await self._get().get_model_config(self.model, as_json=True)
            except Exception as e:  # noqa: BLE001
                raise from_triton(str(e), unavailable=True) from None
            params = cfg.get("config", cfg).get("parameters", {})
            self._max_model_len = int(params.get("max_model_len", {}).get("string_value", 2048))
        return self._max_model_len

    async def stream(self, prompt: str, inputs: dict[str, np.ndarray], prompt_param: str = "prompt"
                     ) -> AsyncIterator[StepOutput]:
        """Run one ``generate`` request and yield its responses as they come; the one with ``finish_reason`` is the
        last. Leaving the iteration early (``aclose``, cancellation) cancels the request in Triton.

        Args:
            prompt: ``text_input``.
            inputs: the other inputs: name -> 1-D numpy array in generate's dtype (``stream`` is set here).
            prompt_param: the OpenAI parameter ``text_input`` came from (named in errors).

        Yields:
            One :class:`StepOutput` per response.

        Raises:
            OpenAIError: 400 for ``generate``'s input errors (naming the OpenAI parameter), 503 when Triton or the
                model is not available, 500 otherwise.
        """
        import grpc
        from tritonclient.grpc import InferInput
        from tritonclient.utils import np_to_triton_dtype

        tensors = []
        arrays = dict(inputs)
        arrays["text_input"] = np.array([prompt.encode("utf-8")], np.object_)
        arrays["stream"] = np.array([True], np.bool_)
        arrays["return_num_input_tokens"] = np.array([True], np.bool_)
        for name, a in arrays.items():
            t = InferInput(name, list(a.shape), "BYTES" if a.dtype == np.object_ else np_to_triton_dtype(a.dtype))
            t.set_data_from_numpy(a)
            tensors.append(t)
        done = asyncio.Event()

        async def requests():
            yield {"model_name": self.model, "inputs": tensors}
            await done.wait()  # keep the stream open until every response is in (or the caller leaves)

        call = None
        try:
            call = self._get().stream_infer(requests())
            async for result, error in call:
                if error is not None:
                    msg = str(error)
                    raise from_triton(msg, _unavailable(msg), prompt_param)
                out = parse_result(result)
                yield out
                if out.finish_reason is not None:
                    return
            raise OpenAIError(503, "the model server closed the stream before the last response",
                              code="service_unavailable")
        except grpc.aio.AioRpcError as e:
            unavailable = e.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED)
            raise from_triton(e.details() or str(e.code()), unavailable or _unavailable(e.details() or ""),
                              prompt_param) from None
        finally:
            done.set()
            if call is not None:
                call.cancel()  # a finished call ignores it; an unfinished one is cancelled in Triton
