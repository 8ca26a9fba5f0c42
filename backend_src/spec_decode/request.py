"""The client contract of ``generate``: parsing and validating a request's inputs.

Tensor names follow the TensorRT-LLM and vLLM Triton backends. Every check raises :class:`InvalidInputError` naming the
field and the allowed values, so ``generate`` can answer with a Triton error response and keep serving.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

METHODS = ("none", "draft", "ngram", "suffix", "hybrid")
MAX_STOP_WORDS = 64  # stop words are checked after every token: bounded so one request cannot slow every stream
MAX_STOP_WORD_CHARS = 1024
CHARS_PER_TOKEN_LIMIT = 32  # text_input longer than max_model_len * this is refused before tokenisation
ACCEPTANCE_METHODS = ("rejection", "typical")


class InvalidInputError(ValueError):
    """A request input is missing or out of range; the message names the field and what is allowed."""

    def __init__(self, field_name: str, message: str):
        super().__init__(f"invalid input '{field_name}': {message}")
        self.field = field_name


@dataclass(frozen=True)
class ServerLimits:
    """Server-side defaults and bounds for requests (from the ``generate`` config parameters).

    Attributes:
        default_method: speculative_method used when the request sends none.
        default_num_draft_tokens: k used when the request sends none.
        max_num_draft_tokens: the largest k a request may ask for.
        max_model_len: prompt + output tokens must fit in this many positions.
        methods: the methods this server can serve (``draft`` only when a draft model is configured).
    """

    default_method: str = "suffix"
    default_num_draft_tokens: int = 4
    max_num_draft_tokens: int = 8
    max_model_len: int = 2048
    methods: tuple[str, ...] = METHODS


@dataclass
class GenerationRequest:
    """A validated ``generate`` request (see README "Client contract")."""

    text_input: str
    max_tokens: int
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    random_seed: int | None = None
    stop_words: list[str] = field(default_factory=list)
    end_id: int | None = None
    stream: bool = False  # as the TensorRT-LLM and vLLM backends: one response unless streaming is asked for
    exclude_input_in_output: bool = False
    return_log_probs: bool = False
    ignore_eos: bool = False  # as vLLM's: generate max_tokens tokens whatever the EOS token (end_id still stops)
    num_draft_tokens: int = 4
    speculative_method: str = "suffix"
    acceptance_method: str = ""  # "" = the verifier's configured default


def _scalar(inputs: dict, name: str, kinds: str, what: str):
    """The single element of an optional input (None when absent); ``kinds`` is numpy dtype kinds allowed."""
    arr = inputs.get(name)
    if arr is None:
        return None
    arr = np.asarray(arr)
    if arr.size != 1:
        raise InvalidInputError(name, f"expected one {what} value, got shape {list(arr.shape)}")
    if arr.dtype.kind not in kinds:
        raise InvalidInputError(name, f"expected {what}, got dtype {arr.dtype}")
    return arr.reshape(-1)[0]


def _text(value, name: str) -> str:
    if isinstance(value, (bytes, np.bytes_)):
        try:
            return bytes(value).decode("utf-8")
        except UnicodeDecodeError as e:
            raise InvalidInputError(name, f"not valid UTF-8 ({e.reason} at byte {e.start})") from None
    if isinstance(value, str):
        return value
    raise InvalidInputError(name, f"expected a UTF-8 string (BYTES), got {type(value).__name__}")


def parse_request(inputs: dict[str, np.ndarray], limits: ServerLimits) -> GenerationRequest:
    """Validate the input tensors of one ``generate`` request.

    Args:
        inputs: input name -> numpy array as Triton delivers it (BYTES inputs as object arrays of bytes).
        limits: server defaults and bounds.

    Returns:
        The validated request.

    Raises:
        InvalidInputError: naming the field and the allowed values.
    """
    raw = _scalar(inputs, "text_input", "OSU", "string")
    if raw is None:
        raise InvalidInputError("text_input", "required (STRING [1])")
    text = _text(raw, "text_input")
    if not text:
        raise InvalidInputError("text_input", "must be a non-empty string")
    if len(text) > limits.max_model_len * CHARS_PER_TOKEN_LIMIT:  # cannot fit: refuse before tokenising it
        raise InvalidInputError("text_input",
                                f"{len(text)} characters; at most {limits.max_model_len * CHARS_PER_TOKEN_LIMIT} "
                                f"(the prompt must fit in max_model_len={limits.max_model_len} tokens)")

    max_tokens = _scalar(inputs, "max_tokens", "iu", "integer")
    if max_tokens is None:
        raise InvalidInputError("max_tokens", "required (INT32 [1])")
    max_tokens = int(max_tokens)
    if not 1 <= max_tokens <= limits.max_model_len:
        raise InvalidInputError("max_tokens", f"must be in [1, {limits.max_model_len}], got {max_tokens}")

    req = GenerationRequest(text_input=text, max_tokens=max_tokens, speculative_method=limits.default_method,
                            num_draft_tokens=limits.default_num_draft_tokens)

    t = _scalar(inputs, "temperature", "f", "FP32")
    if t is not None:
        if not (np.isfinite(t) and 0.0 <= float(t) <= 100.0):
            raise InvalidInputError("temperature", f"must be in [0, 100] (0 = greedy), got {t}")
        req.temperature = float(t)
    k = _scalar(inputs, "top_k", "iu", "integer")
    if k is not None:
        if int(k) < 0:
            raise InvalidInputError("top_k", f"must be >= 0 (0 = disabled), got {k}")
        req.top_k = int(k)
    p = _scalar(inputs, "top_p", "f", "FP32")
    if p is not None:
        if not (np.isfinite(p) and 0.0 < float(p) <= 1.0):
            raise InvalidInputError("top_p", f"must be in (0, 1], got {p}")
        req.top_p = float(p)
    seed = _scalar(inputs, "random_seed", "iu", "integer")
    if seed is not None:
        if int(seed) < 0:
            raise InvalidInputError("random_seed", f"must be >= 0, got {seed}")
        req.random_seed = int(seed) & ((1 << 63) - 1)

    sw = inputs.get("stop_words")
    if sw is not None:
        words = []
        sw = np.asarray(sw, dtype=object).reshape(-1)
        if sw.size > MAX_STOP_WORDS:
            raise InvalidInputError("stop_words", f"at most {MAX_STOP_WORDS} stop words, got {sw.size}")
        for i, w in enumerate(sw):
            try:
                words.append(_text(w, "stop_words"))
            except InvalidInputError as e:
                raise InvalidInputError("stop_words", f"element {i}: {str(e).split(': ', 1)[1]}") from None
            if not words[-1] or len(words[-1]) > MAX_STOP_WORD_CHARS:
                raise InvalidInputError("stop_words", f"element {i}: stop words must be non-empty strings of at most "
                                        f"{MAX_STOP_WORD_CHARS} characters, got {len(words[-1])}")
        req.stop_words = words
    end_id = _scalar(inputs, "end_id", "iu", "integer")
    if end_id is not None:
        req.end_id = int(end_id)

    for name in ("stream", "exclude_input_in_output", "return_log_probs", "ignore_eos"):
        v = _scalar(inputs, name, "biu", "BOOL")
        if v is not None:
            setattr(req, name, bool(v))

    method = _scalar(inputs, "speculative_method", "OSU", "string")
    if method is not None:
        method = _text(method, "speculative_method").strip().lower()
        if method not in limits.methods:
            raise InvalidInputError("speculative_method", f"{method!r} is not one of {', '.join(limits.methods)}")
        req.speculative_method = method
    am = _scalar(inputs, "acceptance_method", "OSU", "string")
    if am is not None:
        am = _text(am, "acceptance_method").strip().lower()
        if am not in ACCEPTANCE_METHODS:
            raise InvalidInputError(
                "acceptance_method", f"{am!r} is not one of {', '.join(ACCEPTANCE_METHODS)} (typical is not lossless)"
            )
        req.acceptance_method = am
    nd = _scalar(inputs, "num_draft_tokens", "iu", "integer")
    if nd is not None:
        if not 0 <= int(nd) <= limits.max_num_draft_tokens:
            raise InvalidInputError(
                "num_draft_tokens", f"must be in [0, {limits.max_num_draft_tokens}], got {int(nd)}"
            )
        req.num_draft_tokens = int(nd)
    return req
