"""generate's input tensors decoded and checked into a :class:`~spec_decode.request.GenerationRequest`.

The tensors are :data:`.wire.CLIENT`'s (the TensorRT-LLM and vLLM Triton backends' names); docs/client.md is the
contract. What depends on the server (its methods, largest k, max_model_len, vocabulary) is checked here, against
:class:`RequestLimits`; what does not, by the request itself. Every error is an
:class:`~spec_decode.settings.InvalidInputError` naming the input and the allowed values.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..request import GenerationRequest
from ..settings import GenerateSettings, InvalidInputError, check_acceptance_method, decode_text, in_range, one_of
from .wire import CLIENT, scalar, text

MAX_STOP_WORDS = 64  # stop words are checked after every token: bounded so one request cannot slow every stream
MAX_STOP_WORD_CHARS = 1024
CHARS_PER_TOKEN_LIMIT = 32  # text_input longer than max_model_len * this is refused before tokenisation


@dataclass(frozen=True)
class RequestLimits:
    """What a ``generate`` request is checked against.

    Attributes:
        settings: generate's settings (the default method and k, the largest k, max_model_len).
        methods: the methods this server offers (:func:`spec_decode.proposers.offered_methods`).
        vocab_size: the tokenizer's vocabulary size (``end_id`` must be below it), or None (not checked).
    """

    settings: GenerateSettings
    methods: tuple[str, ...]
    vocab_size: int | None = None


def parse_request(inputs: dict[str, np.ndarray], limits: RequestLimits) -> GenerationRequest:
    """Validate the input tensors of one ``generate`` request.

    Args:
        inputs: input name -> numpy array as Triton delivers it (BYTES inputs as object arrays of bytes).
        limits: server defaults and bounds.

    Returns:
        The validated request.

    Raises:
        InvalidInputError: naming the field and the allowed values.
    """
    settings = limits.settings
    max_len = settings.max_model_len
    prompt = text(inputs, "text_input", tensors=CLIENT)
    if not prompt:
        raise InvalidInputError("text_input", "must be a non-empty string")
    if len(prompt) > max_len * CHARS_PER_TOKEN_LIMIT:  # cannot fit: refuse before tokenising it
        raise InvalidInputError("text_input", f"{len(prompt)} characters; at most {max_len * CHARS_PER_TOKEN_LIMIT} "
                                              f"(the prompt must fit in max_model_len={max_len} tokens)")
    max_tokens = scalar(inputs, "max_tokens", tensors=CLIENT)
    fields = {"text_input": prompt, "max_tokens": in_range("max_tokens", int(max_tokens), 1, max_len)}

    for name, cast in (("temperature", float), ("top_p", float), ("top_k", int), ("random_seed", int),
                       ("end_id", int), ("num_draft_tokens", int)):
        v = scalar(inputs, name, None, CLIENT)
        if v is not None:
            fields[name] = cast(v)
    if "random_seed" in fields:
        fields["random_seed"] = in_range("random_seed", fields["random_seed"], 0) & ((1 << 63) - 1)
    if "end_id" in fields and limits.vocab_size is not None and not 0 <= fields["end_id"] < limits.vocab_size:
        raise InvalidInputError("end_id", f"must be a token id in [0, {limits.vocab_size}), got {fields['end_id']}")
    in_range("num_draft_tokens", fields.setdefault("num_draft_tokens", settings.num_draft_tokens), 0,
             settings.max_num_draft_tokens)

    sw = inputs.get("stop_words")
    if sw is not None:
        words = []
        sw = np.asarray(sw, dtype=object).reshape(-1)
        if sw.size > MAX_STOP_WORDS:
            raise InvalidInputError("stop_words", f"at most {MAX_STOP_WORDS} stop words, got {sw.size}")
        for i, w in enumerate(sw):
            try:
                words.append(decode_text(w, "stop_words"))
            except InvalidInputError as e:
                raise InvalidInputError("stop_words", f"element {i}: {e.detail}") from None
            if not words[-1] or len(words[-1]) > MAX_STOP_WORD_CHARS:
                raise InvalidInputError("stop_words", f"element {i}: stop words must be non-empty strings of at most "
                                        f"{MAX_STOP_WORD_CHARS} characters, got {len(words[-1])}")
        fields["stop_words"] = tuple(words)

    for name in ("stream", "exclude_input_in_output", "return_log_probs", "ignore_eos"):
        v = scalar(inputs, name, None, CLIENT)
        if v is not None:
            fields[name] = bool(v)

    fields["speculative_method"] = one_of("speculative_method", text(inputs, "speculative_method",
                                                                     settings.default_speculative_method, CLIENT),
                                          limits.methods)
    am = text(inputs, "acceptance_method", None, CLIENT)
    if am is not None:
        fields["acceptance_method"] = check_acceptance_method("acceptance_method", am)
    return GenerationRequest(**fields)
