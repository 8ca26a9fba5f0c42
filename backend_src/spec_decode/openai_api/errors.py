"""OpenAI-style errors: the status code and the JSON body the official clients parse.

The body is ``{"error": {"message", "type", "param", "code"}}`` as OpenAI's API reference describes its error objects
(https://platform.openai.com/docs/guides/error-codes); the official Python client raises ``openai.BadRequestError``
(400), ``AuthenticationError`` (401), ``NotFoundError`` (404), ``UnprocessableEntityError`` (422),
``InternalServerError`` (>= 500) from the status and keeps the body.
"""

from __future__ import annotations

import re

_TYPES = {400: "invalid_request_error", 401: "invalid_request_error", 404: "invalid_request_error",
          405: "invalid_request_error", 413: "invalid_request_error", 415: "invalid_request_error"}

# generate's input errors (spec_decode.settings.InvalidInputError): "invalid input '<field>': <detail>"
_INVALID_INPUT = re.compile(r"invalid input '([^']+)': (.*)", re.S)

# generate's input names -> the OpenAI parameter a user set (to name it in the error)
GENERATE_TO_OPENAI = {
    "random_seed": "seed",
    "seed": "seed",
    "stop_words": "stop",
    "guided_decoding_guide": "response_format",
    "guided_decoding_guide_type": "response_format",
    "text_input": "prompt",
}


class OpenAIError(Exception):
    """An error answered as OpenAI does: HTTP ``status`` with :meth:`body`.

    Args:
        status: the HTTP status (400 bad value, 401 bad API key, 404 unknown model or route, 413 body too large,
            500 internal, 503 Triton not ready).
        message: what is wrong and what is allowed.
        param: the request parameter at fault (OpenAI's name), or None.
        code: OpenAI's machine-readable code (e.g. ``model_not_found``, ``invalid_api_key``), or None.
    """

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code

    def body(self) -> dict:
        """The JSON error object: ``{"error": {"message", "type", "param", "code"}}``."""
        kind = _TYPES.get(self.status, "server_error" if self.status >= 500 else "invalid_request_error")
        return {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}}


def bad_value(param: str, detail: str) -> OpenAIError:
    """A 400 naming ``param``: ``"'<param>': <detail>"``."""
    return OpenAIError(400, f"'{param}': {detail}", param=param)


def from_triton(message: str, unavailable: bool = False, prompt_param: str = "prompt") -> OpenAIError:
    """The OpenAI error for a ``generate`` error (Triton's message string).

    Args:
        message: the error message Triton returned.
        unavailable: the server could not be reached or is not ready (gRPC UNAVAILABLE, a model not ready).
        prompt_param: the OpenAI parameter that became ``text_input`` (``prompt`` or ``messages``).

    Returns:
        503 when ``unavailable``; 400 naming the OpenAI parameter for generate's input errors; else 500.
    """
    if unavailable:
        return OpenAIError(503, f"the model server is not ready: {message.strip()[:300]}", code="service_unavailable")
    m = _INVALID_INPUT.search(message)
    if m is None:
        return OpenAIError(500, f"generation failed: {message.strip()[:500]}")
    field, detail = m.group(1), m.group(2).strip()
    param = GENERATE_TO_OPENAI.get(field, field)
    if param == "prompt":
        param = prompt_param
    return bad_value(param, detail)
