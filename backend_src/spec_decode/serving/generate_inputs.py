"""generate's input tensors decoded and checked into a :class:`~spec_decode.request.GenerationRequest`.

The tensors are :data:`.wire.CLIENT`'s (the TensorRT-LLM and vLLM Triton backends' names); docs/client.md is the
contract. What depends on the server (its methods, largest k, max_model_len, vocabulary) is checked here, against
:class:`RequestLimits`; what does not, by the request itself. Every error is an
:class:`~spec_decode.settings.InvalidInputError` naming the input and the allowed values.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..processors import GUIDE_TYPES, MAX_TOP_LOGPROBS
from ..request import GenerationRequest
from ..settings import GenerateSettings, InvalidInputError, check_acceptance_method, decode_text, in_range, one_of
from .wire import CLIENT, GENERATE_INPUTS, scalar, text

MAX_STOP_WORDS = 64  # stop words are checked after every token, bad words at every position: bounded per request
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


def _words(inputs: dict, name: str) -> tuple[str, ...] | None:
    """A STRING [-1] input of words (stop_words, bad_words) decoded and bounded, or None when absent."""
    sw = inputs.get(name)
    if sw is None:
        return None
    words = []
    sw = np.asarray(sw, dtype=object).reshape(-1)
    if sw.size > MAX_STOP_WORDS:
        raise InvalidInputError(name, f"at most {MAX_STOP_WORDS} {name.replace('_', ' ')}, got {sw.size}")
    for i, w in enumerate(sw):
        try:
            words.append(decode_text(w, name))
        except InvalidInputError as e:
            raise InvalidInputError(name, f"element {i}: {e.detail}") from None
        if not words[-1] or len(words[-1]) > MAX_STOP_WORD_CHARS:
            raise InvalidInputError(name, f"element {i}: words must be non-empty strings of at most "
                                          f"{MAX_STOP_WORD_CHARS} characters, got {len(words[-1])}")
    return tuple(words)


def check_parameters(parameters: dict) -> None:
    """Refuse request parameters: over HTTP, Triton's generate extension turns every JSON key that names no input of
    ``generate`` into a request parameter, so a misspelt or unsupported control would otherwise be ignored silently.

    Raises:
        InvalidInputError: naming the first unknown key and listing the accepted inputs.
    """
    for key in sorted(parameters):
        raise InvalidInputError(key, f"unknown input of generate; accepted: {', '.join(sorted(GENERATE_INPUTS))}")


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
    seed = scalar(inputs, "seed", None, CLIENT)  # random_seed's other name (NVIDIA's OpenAI frontend sends it)
    if seed is not None:
        seed = in_range("seed", int(seed), 0)
        if "random_seed" in fields and fields["random_seed"] != seed:
            raise InvalidInputError("seed", f"is random_seed's other name: send one of them, or equal values (got "
                                            f"random_seed={fields['random_seed']}, seed={seed})")
        fields["random_seed"] = seed
    if "random_seed" in fields:
        fields["random_seed"] = in_range("random_seed", fields["random_seed"], 0) & ((1 << 63) - 1)
    if "end_id" in fields and limits.vocab_size is not None and not 0 <= fields["end_id"] < limits.vocab_size:
        raise InvalidInputError("end_id", f"must be a token id in [0, {limits.vocab_size}), got {fields['end_id']}")
    in_range("num_draft_tokens", fields.setdefault("num_draft_tokens", settings.num_draft_tokens), 0,
             settings.max_num_draft_tokens)

    for name in ("stop_words", "bad_words"):
        words = _words(inputs, name)
        if words is not None:
            fields[name] = words

    for name in ("beam_width", "num_return_sequences", "n"):  # several samples per request: not yet
        v = scalar(inputs, name, None, CLIENT)
        if v is not None and int(v) != 1:
            raise InvalidInputError(name, f"must be 1, got {int(v)}: one sample per request is supported (send "
                                          f"several requests, with different random_seed values, for several)")
    for name, cast in (("repetition_penalty", float), ("presence_penalty", float), ("frequency_penalty", float),
                       ("min_tokens", int), ("top_logprobs", int), ("prompt_logprobs", int), ("tree_top_k", int),
                       ("tree_depth", int)):
        v = scalar(inputs, name, None, CLIENT)
        if v is not None:
            fields[name] = cast(v)
    min_length = scalar(inputs, "min_length", None, CLIENT)
    if min_length is not None:
        if "min_tokens" in fields and fields["min_tokens"] != int(min_length):
            raise InvalidInputError("min_length", f"is min_tokens' older name: send one of them (got min_tokens="
                                                  f"{fields['min_tokens']}, min_length={int(min_length)})")
        fields["min_tokens"] = int(min_length)
    if "prompt_logprobs" in fields:
        in_range("prompt_logprobs", fields["prompt_logprobs"], 0, MAX_TOP_LOGPROBS)
    ids = inputs.get("stop_token_ids")
    if ids is not None:
        arr = np.asarray(ids).reshape(-1)
        if arr.dtype.kind not in "iu":
            raise InvalidInputError("stop_token_ids", f"expected integers, got dtype {arr.dtype}")
        if arr.size > MAX_STOP_WORDS:
            raise InvalidInputError("stop_token_ids", f"at most {MAX_STOP_WORDS} ids, got {arr.size}")
        vocab = limits.vocab_size
        bad = [int(t) for t in arr if t < 0 or (vocab is not None and t >= vocab)]
        if bad:
            raise InvalidInputError("stop_token_ids", f"token ids must lie in [0, {vocab}), got {bad[0]}")
        fields["stop_token_ids"] = tuple(int(t) for t in arr)
    guide_type = text(inputs, "guided_decoding_guide_type", None, CLIENT)
    guide = text(inputs, "guided_decoding_guide", None, CLIENT)
    if guide_type is not None and guide_type.strip():
        fields["guided_decoding_guide_type"] = one_of("guided_decoding_guide_type", guide_type, GUIDE_TYPES)
        fields["guided_decoding_guide"] = guide or ""
    elif guide:
        raise InvalidInputError("guided_decoding_guide", f"needs guided_decoding_guide_type (one of "
                                                         f"{', '.join(GUIDE_TYPES)})")

    fields["draft_tree"] = settings.draft_tree
    for name in ("stream", "exclude_input_in_output", "return_log_probs", "ignore_eos", "return_num_input_tokens",
                 "return_num_output_tokens", "draft_tree"):
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
