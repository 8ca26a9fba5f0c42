"""The OpenAI-compatible HTTP server: a Starlette app (served by uvicorn) in front of Triton's ``generate``.

Routes: ``GET /v1/models``, ``GET /v1/models/{model}``, ``POST /v1/completions``, ``POST /v1/chat/completions``
(OpenAI's API reference), and ``GET /health`` (200 once Triton's ``generate`` is READY, else 503). Each completion is
one ``generate`` request over gRPC streaming (:class:`.triton.TritonGenerate`); streamed completions are server-sent
events with one chunk per speculative step (a step's accepted tokens in one delta). A client that leaves cancels its
Triton request. Errors are OpenAI's error objects (:mod:`.errors`). docs/openai.md is the user's guide.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any

import numpy as np
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from .errors import OpenAIError, bad_value
from .params import GenerateCall, parse_chat, parse_completion
from .responses import Reply, merge_logprobs, sse
from .token_bytes import token_bytes_reader
from .triton import StepOutput, TritonGenerate

DEFAULT_MAX_BODY_BYTES = 4 << 20
BODY_TIMEOUT_S = 60.0  # a client that sends less than its Content-Length gets a 408, not a connection held forever


def served_name(model_path) -> str:
    """The model name served by default: the target's folder name (e.g. ``SmolLM2-135M-Instruct``)."""
    from pathlib import Path

    return Path(model_path).resolve().name


@dataclass
class Served:
    """What the app serves and how.

    Attributes:
        triton: the ``generate`` client.
        tokenizer: the target's tokenizer (transformers), for the chat template and the log-probs' token texts.
        names: the model names clients may send (``GET /v1/models`` lists them).
        api_key: when set, every ``/v1`` request must carry ``Authorization: Bearer <api_key>`` (compared in constant
            time, :func:`hmac.compare_digest`).
        max_body_bytes: larger request bodies are refused with 413.
    """

    triton: TritonGenerate
    tokenizer: Any
    names: tuple[str, ...]
    api_key: str | None = None
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    created: int = field(default_factory=lambda: int(time.time()))

    def __post_init__(self):
        self.token_text = lru_cache(maxsize=1 << 16)(self._token_text)
        self.token_bytes = token_bytes_reader(self.tokenizer)

    def _token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id])

    def render(self, messages: list[dict[str, str]]) -> str:
        """The prompt for chat ``messages``: the tokenizer's chat template with the generation prompt, as
        transformers' ``apply_chat_template(..., tokenize=False, add_generation_prompt=True)`` renders it.

        Raises:
            OpenAIError: 400 (``messages``) when the tokenizer has no chat template or the template refuses them.
        """
        if not getattr(self.tokenizer, "chat_template", None):
            raise bad_value("messages", "this model's tokenizer has no chat template: use /v1/completions")
        try:
            return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        except Exception as e:  # noqa: BLE001 - a template's own raise_exception(...) for messages it refuses
            raise bad_value("messages", f"the chat template refused them: {e}") from None


def _served(request: Request) -> Served:
    return request.app.state.served


def _authorize(request: Request) -> None:
    key = _served(request).api_key
    if not key:
        return
    auth = request.headers.get("authorization", "")
    given = auth[7:].strip() if auth[:7].lower() == "bearer " else ""
    if not hmac.compare_digest(given.encode(), key.encode()):
        raise OpenAIError(401, "Incorrect API key provided (send 'Authorization: Bearer <key>')",
                          code="invalid_api_key")


async def _read_json(request: Request, limit: int) -> Any:
    """The body as JSON: 413 over ``limit`` bytes, 408 when it does not arrive within :data:`BODY_TIMEOUT_S`, 400 when
    it is not JSON, is nested too deeply, or holds text that is not Unicode (an unpaired surrogate escape)."""
    length = request.headers.get("content-length", "")
    if length.isdigit() and int(length) > limit:
        raise OpenAIError(413, f"the request body is {int(length)} bytes; at most {limit}", code="request_too_large")
    chunks, size = [], 0
    try:
        async with asyncio.timeout(BODY_TIMEOUT_S):
            async for chunk in request.stream():
                size += len(chunk)
                if size > limit:
                    raise OpenAIError(413, f"the request body is over {limit} bytes", code="request_too_large")
                chunks.append(chunk)
    except TimeoutError:
        raise OpenAIError(408, f"the request body did not arrive within {BODY_TIMEOUT_S:.0f} s") from None
    try:
        body = json.loads(b"".join(chunks))
        json.dumps(body, ensure_ascii=False).encode("utf-8")  # every string must be text that can be encoded
    except RecursionError:
        raise OpenAIError(400, "the request body is nested too deeply") from None
    except UnicodeEncodeError:
        raise OpenAIError(400, "the request body holds an unpaired UTF-16 surrogate (e.g. \\ud800): not text") from None
    except ValueError as e:
        raise OpenAIError(400, f"the request body is not valid JSON: {e}") from None
    return body


async def _first(steps: AsyncIterator[StepOutput]) -> StepOutput:
    """The first step, or the request's error before any byte of the response is sent."""
    try:
        return await steps.__anext__()
    except BaseException:
        await steps.aclose()  # type: ignore[attr-defined]
        raise


async def _events(reply: Reply, first: StepOutput, steps) -> AsyncIterator[str]:
    """The server-sent events of a streamed completion: one chunk per step; the usage chunk; ``[DONE]``."""
    call = reply.call
    try:
        if call.chat:
            yield reply.chunk("", role=True)
        elif call.echo:
            yield reply.chunk(call.prompt)
        step = first
        while True:
            reply.count(step)
            lp = reply.logprobs(step)
            if step.finish_reason is not None:
                yield reply.chunk(step.text if step.text or not call.chat else None, step.finish_reason, lp)
                break
            if step.text or step.token_ids:
                yield reply.chunk(step.text, None, lp)
            step = await steps.__anext__()
        if call.include_usage:
            yield reply.usage_chunk()
    except OpenAIError as e:  # after the first byte: the error travels as an event, as vLLM's server sends it
        yield sse(e.body())
    finally:
        await steps.aclose()
    yield sse("[DONE]")


async def _whole(reply: Reply, steps) -> JSONResponse:
    texts, parts, reason = [], [], None
    async with contextlib.aclosing(steps):
        async for step in steps:
            reply.count(step)
            texts.append(step.text)
            lp = reply.logprobs(step)
            if lp is not None:
                parts.append(lp)
            reason = step.finish_reason
    return JSONResponse(reply.whole("".join(texts), reason, merge_logprobs(parts, reply.call.chat)))


class _Disconnected(Exception):
    """The client closed the connection before the response started."""


async def _unless_disconnected(request: Request, work):
    """``work``'s result (a coroutine), unless the client disconnects first: then ``work`` is cancelled (and with it
    the Triton request) and :class:`_Disconnected` raised."""
    async def disconnected() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    task, watch = asyncio.ensure_future(work), asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
    if task.done():
        return task.result()
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError, OpenAIError):
        await task
    raise _Disconnected


async def _complete(request: Request, chat: bool) -> Response:
    served = _served(request)
    _authorize(request)
    body = await _read_json(request, served.max_body_bytes)
    call: GenerateCall = parse_chat(body, served.render) if chat else parse_completion(body)
    if call.model not in served.names:
        raise OpenAIError(404, f"The model '{call.model}' does not exist; served: {', '.join(served.names)}",
                          param="model", code="model_not_found")
    if "max_tokens" not in call.inputs:  # chat without a limit: up to the context's end, as vLLM
        call.inputs["max_tokens"] = np.array([await served.triton.max_model_len()], np.int32)
    reply = Reply(call, served.token_bytes, served.token_text)
    steps = served.triton.stream(call.prompt, call.inputs, "messages" if chat else "prompt")
    try:
        if not call.stream:
            return await _unless_disconnected(request, _whole(reply, steps))
        first = await _unless_disconnected(request, _first(steps))  # a long prefill: the client may leave meanwhile
    except _Disconnected:
        return Response(status_code=499)  # nobody is there to read it
    return StreamingResponse(_events(reply, first, steps), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


async def completions(request: Request) -> Response:
    """``POST /v1/completions``."""
    return await _complete(request, chat=False)


async def chat_completions(request: Request) -> Response:
    """``POST /v1/chat/completions``."""
    return await _complete(request, chat=True)


def _model(served: Served, name: str) -> dict:
    return {"id": name, "object": "model", "created": served.created, "owned_by": "spec_decode"}


async def models(request: Request) -> Response:
    """``GET /v1/models``: the served model names."""
    _authorize(request)
    served = _served(request)
    return JSONResponse({"object": "list", "data": [_model(served, n) for n in served.names]})


async def model(request: Request) -> Response:
    """``GET /v1/models/{model}``; 404 for a name not served."""
    _authorize(request)
    served, name = _served(request), request.path_params["model"]
    if name not in served.names:
        raise OpenAIError(404, f"The model '{name}' does not exist", param="model", code="model_not_found")
    return JSONResponse(_model(served, name))


async def health(request: Request) -> Response:
    """``GET /health``: 200 when Triton's ``generate`` is READY, else 503 (for load balancers and the launcher)."""
    if await _served(request).triton.ready():
        return JSONResponse({"status": "ready"})
    return _error(OpenAIError(503, "Triton's generate model is not ready", code="service_unavailable"))


def _error(e: OpenAIError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status)


async def _on_openai_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, OpenAIError)
    return _error(exc)


async def _on_http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    what = "route" if exc.status_code == 404 else "method"
    return _error(OpenAIError(exc.status_code, f"{exc.detail}: no such {what} ({request.method} {request.url.path})"))


def build_app(served: Served) -> Starlette:
    """The Starlette app serving ``served`` (module docstring lists the routes)."""
    async def lifespan(app):
        yield
        await served.triton.close()

    app = Starlette(
        routes=[
            Route("/v1/completions", completions, methods=["POST"]),
            Route("/v1/chat/completions", chat_completions, methods=["POST"]),
            Route("/v1/models", models, methods=["GET"]),
            Route("/v1/models/{model:path}", model, methods=["GET"]),
            Route("/health", health, methods=["GET"]),
        ],
        exception_handlers={OpenAIError: _on_openai_error, HTTPException: _on_http_error},
        lifespan=contextlib.asynccontextmanager(lifespan),
    )
    app.state.served = served
    return app
