"""OpenAI request bodies checked and turned into one ``generate`` request (docs/openai.md).

``POST /v1/completions`` and ``POST /v1/chat/completions`` bodies follow OpenAI's API reference; the controls OpenAI
does not have ride in the body as vLLM's server takes them (``top_k``, ``min_tokens``, ``repetition_penalty``,
``ignore_eos``, ``stop_token_ids``, ``speculative_method``, ``num_draft_tokens``, ``acceptance_method``; the draft
tree's ``draft_tree``, ``tree_top_k`` and ``tree_depth``). Each becomes
the ``generate`` input of docs/client.md of the same meaning; what ``generate`` checks itself (ranges, the methods the
server offers) is left to it and its error comes back naming the OpenAI parameter (:func:`.errors.from_triton`).
What cannot be served (``n`` > 1, tools, images, ``logit_bias``, ``suffix``) is refused here with a 400 naming the
field; an unknown key is refused too, so a misspelt control is not silently ignored.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .errors import OpenAIError, bad_value

MAX_TOP_LOGPROBS = 20  # generate's bound (spec_decode.processors.MAX_TOP_LOGPROBS), OpenAI's for chat
INT32_MAX = (1 << 31) - 1  # generate's integer inputs are INT32: larger values are refused, not wrapped
DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions

# Keys of OpenAI's request bodies that change nothing here (accepted and ignored).
_IGNORED = {"user", "store", "metadata", "service_tier", "parallel_tool_calls", "prompt_cache_key",
            "safety_identifier", "stream_options"}
# name -> (generate input, numpy dtype, Python type checked)
_SCALARS = {
    "temperature": ("temperature", np.float32, float),
    "top_p": ("top_p", np.float32, float),
    "presence_penalty": ("presence_penalty", np.float32, float),
    "frequency_penalty": ("frequency_penalty", np.float32, float),
    "repetition_penalty": ("repetition_penalty", np.float32, float),
    "top_k": ("top_k", np.int32, int),
    "min_tokens": ("min_tokens", np.int32, int),
    "num_draft_tokens": ("num_draft_tokens", np.int32, int),
    "draft_tree": ("draft_tree", np.bool_, bool),
    "tree_top_k": ("tree_top_k", np.int32, int),
    "tree_depth": ("tree_depth", np.int32, int),
    "ignore_eos": ("ignore_eos", np.bool_, bool),
    "speculative_method": ("speculative_method", np.object_, str),
    "acceptance_method": ("acceptance_method", np.object_, str),
}
_COMMON = set(_SCALARS) | {"model", "stream", "max_tokens", "seed", "stop", "n", "logit_bias", "response_format",
                           "stop_token_ids", "best_of"} | _IGNORED
COMPLETION_KEYS = _COMMON | {"prompt", "logprobs", "echo", "suffix"}
CHAT_KEYS = _COMMON | {"messages", "logprobs", "top_logprobs", "max_completion_tokens", "tools", "tool_choice",
                       "functions", "function_call", "modalities", "audio", "prediction", "reasoning_effort"}


@dataclass
class GenerateCall:
    """One OpenAI request as a ``generate`` request.

    Attributes:
        chat: a chat completion (else a text completion).
        model: the ``model`` the client named (echoed in the response).
        prompt: ``text_input``: the prompt, or the messages rendered with the chat template.
        inputs: the other ``generate`` inputs: name -> 1-D numpy array (shape [1], or [n] for the lists), in
            ``generate``'s dtypes (docs/client.md).
        stream: answer as server-sent events.
        include_usage: (streaming) a last chunk with the usage counts (``stream_options.include_usage``).
        logprobs: None for none; else the number of alternatives per token (0 = the chosen token's alone).
        echo: (completions) the prompt is put in front of the completion.
    """

    chat: bool
    model: str
    prompt: str
    inputs: dict[str, np.ndarray] = field(default_factory=dict)
    stream: bool = False
    include_usage: bool = False
    logprobs: int | None = None
    echo: bool = False


def _typed(body: dict, name: str, kind: type, default: Any = None, wide: bool = False) -> Any:
    """``body[name]`` checked to be of ``kind`` (an int is a float, and a float of a whole value is an int, as
    pydantic's lax mode in vLLM's server takes them; a bool is neither; an int fits in 32 bits unless ``wide``), or
    ``default`` when absent or null."""
    v = body.get(name)
    if v is None:
        return default
    ok = isinstance(v, kind) and not (kind in (int, float) and isinstance(v, bool))
    if kind is float and isinstance(v, int) and not isinstance(v, bool):
        try:
            ok, v = True, float(v)
        except OverflowError:
            raise bad_value(name, f"{str(v)[:20]}... is too large") from None
    if kind is int and isinstance(v, float) and v.is_integer():
        ok, v = True, int(v)
    if ok and kind is int and not wide and not -INT32_MAX - 1 <= v <= INT32_MAX:
        raise bad_value(name, f"must fit in 32 bits, got {str(v)[:40]}")
    if not ok:
        names = {float: "a number", int: "an integer", bool: "true or false", str: "a string", dict: "an object",
                 list: "an array"}
        raise bad_value(name, f"must be {names.get(kind, kind.__name__)}, got {json.dumps(v)[:80]}")
    return v


def _check_keys(body: dict, allowed: set[str], endpoint: str) -> None:
    for key in sorted(body):
        if key not in allowed:
            raise bad_value(key, f"unknown parameter of {endpoint}; accepted: {', '.join(sorted(allowed))}")


def _model(body: Any, allowed: set[str], endpoint: str) -> str:
    """The body checked to be an object of known keys naming a ``model``; that model."""
    if not isinstance(body, dict):
        raise OpenAIError(400, "the request body must be a JSON object")
    _check_keys(body, allowed, endpoint)
    model = _typed(body, "model", str)
    if not model:
        raise bad_value("model", "is required (GET /v1/models lists the served models)")
    return model


def _stop(body: dict) -> list[str] | None:
    stop = body.get("stop")
    if stop is None:
        return None
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
        raise bad_value("stop", "must be a non-empty string or an array of non-empty strings")
    return stop or None


def _response_format(body: dict) -> tuple[str, str] | None:
    """(guided_decoding_guide_type, guide) for ``response_format``, or None for text."""
    rf = _typed(body, "response_format", dict)
    if rf is None:
        return None
    kind = rf.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return "json", ""
    if kind == "json_schema":
        js = rf.get("json_schema")
        schema = js.get("schema") if isinstance(js, dict) else None
        if not isinstance(schema, dict):
            raise bad_value("response_format", "json_schema needs 'json_schema': {'name': ..., 'schema': {...}}")
        return "json_schema", json.dumps(schema)
    raise bad_value("response_format", f"'type' must be one of text, json_object, json_schema, got {kind!r}")


def _common(body: dict, call: GenerateCall, max_tokens: int | None, max_tokens_name: str = "max_tokens") -> None:
    """The parameters both endpoints share, into ``call.inputs`` (``max_tokens`` None: none sent; the app fills in
    max_model_len)."""
    inputs = call.inputs
    call.stream = bool(_typed(body, "stream", bool, False))
    opts = _typed(body, "stream_options", dict)
    if opts is not None:
        if not call.stream:
            raise bad_value("stream_options", "only allowed when 'stream' is true")
        call.include_usage = bool(_typed(opts, "include_usage", bool, False))
    n = _typed(body, "n", int, 1)
    if n != 1:
        raise bad_value("n", f"must be 1, got {n}: one choice per request is served (send several requests, with "
                             f"different seeds, for several)")
    best_of = _typed(body, "best_of", int, 1)
    if best_of != 1:
        raise bad_value("best_of", f"must be 1, got {best_of}")
    if body.get("logit_bias"):
        raise bad_value("logit_bias", "is not supported (use stop_token_ids, or bad words through Triton's generate)")
    if max_tokens is not None:
        if max_tokens < 1:
            raise bad_value(max_tokens_name, f"must be >= 1, got {max_tokens}")
        inputs["max_tokens"] = np.array([max_tokens], np.int32)
    for name, (inp, dtype, kind) in _SCALARS.items():
        v = _typed(body, name, kind)
        if v is not None:
            inputs[inp] = np.array([v.encode() if kind is str else v], dtype)
    seed = _typed(body, "seed", int, wide=True)
    if seed is not None:
        if not 0 <= seed < 1 << 64:
            raise bad_value("seed", f"must be in [0, 2**64), got {seed}")
        inputs["random_seed"] = np.array([seed], np.uint64)
    stop = _stop(body)
    if stop:
        inputs["stop_words"] = np.array([s.encode() for s in stop], np.object_)
    ids = _typed(body, "stop_token_ids", list)
    if ids:
        if not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t <= INT32_MAX for t in ids):
            raise bad_value("stop_token_ids", "must be an array of token ids (integers >= 0)")
        inputs["stop_token_ids"] = np.array(ids, np.int32)
    guide = _response_format(body)
    if guide is not None:
        inputs["guided_decoding_guide_type"] = np.array([guide[0].encode()], np.object_)
        inputs["guided_decoding_guide"] = np.array([guide[1].encode()], np.object_)
    if call.logprobs is not None:
        inputs["return_log_probs"] = np.array([True], np.bool_)
        if call.logprobs > 0:
            inputs["top_logprobs"] = np.array([call.logprobs], np.int32)


def parse_completion(body: Any) -> GenerateCall:
    """A ``POST /v1/completions`` body as a ``generate`` request.

    Args:
        body: the decoded JSON body.

    Returns:
        The call (``max_tokens`` defaults to 16, as OpenAI's).

    Raises:
        OpenAIError: 400 naming the parameter at fault.
    """
    model = _model(body, COMPLETION_KEYS, "/v1/completions")
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if not isinstance(prompt, str) or not prompt:
        raise bad_value("prompt", "must be one non-empty string (token-id prompts and several prompts per request "
                                  "are not served)")
    if body.get("suffix"):
        raise bad_value("suffix", "is not supported (fill-in-the-middle needs a model trained for it)")
    call = GenerateCall(chat=False, model=model, prompt=prompt, echo=bool(_typed(body, "echo", bool, False)))
    lp = _typed(body, "logprobs", int)
    if lp is not None:
        if not 0 <= lp <= MAX_TOP_LOGPROBS:
            raise bad_value("logprobs", f"must be in [0, {MAX_TOP_LOGPROBS}], got {lp}")
        call.logprobs = lp
    if call.echo and call.logprobs is not None:
        raise bad_value("echo", "cannot be combined with logprobs (the prompt's log-probs are served by Triton's "
                                "generate: prompt_logprobs)")
    _common(body, call, _typed(body, "max_tokens", int, DEFAULT_COMPLETION_MAX_TOKENS))
    return call


def chat_messages(body: dict) -> list[dict[str, str]]:
    """``messages`` checked and flattened for the chat template: [{"role", "content"}] with text content.

    ``developer`` becomes ``system`` (OpenAI's newer name); content parts of type ``text`` are joined.

    Raises:
        OpenAIError: 400 naming ``messages[i]...``: a missing or unknown role, a non-text part (images, audio), a
            tool message.
    """
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise bad_value("messages", "must be a non-empty array of {'role', 'content'} objects")
    out = []
    for i, m in enumerate(msgs):
        if not isinstance(m, dict):
            raise bad_value(f"messages[{i}]", "must be an object with 'role' and 'content'")
        role = m.get("role")
        if role == "developer":
            role = "system"
        if role not in ("system", "user", "assistant"):
            raise bad_value(f"messages[{i}].role", f"must be one of system, developer, user, assistant, got {role!r}"
                                                   f" (tool messages are not served)")
        if m.get("tool_calls"):
            raise bad_value(f"messages[{i}].tool_calls", "tools are not supported")
        content = m.get("content")
        if isinstance(content, list):
            texts = []
            for j, part in enumerate(content):
                kind = part.get("type") if isinstance(part, dict) else None
                if kind != "text" or not isinstance(part.get("text"), str):
                    raise bad_value(f"messages[{i}].content[{j}].type", f"only 'text' parts are served, got "
                                                                        f"{kind!r} (images and audio are not)")
                texts.append(part["text"])
            content = "".join(texts)
        if content is None and role == "assistant":
            content = ""
        if not isinstance(content, str):
            raise bad_value(f"messages[{i}].content", "must be a string or an array of text parts")
        out.append({"role": role, "content": content})
    return out


def parse_chat(body: Any, render) -> GenerateCall:
    """A ``POST /v1/chat/completions`` body as a ``generate`` request.

    Args:
        body: the decoded JSON body.
        render: messages -> prompt text (the target tokenizer's chat template with the generation prompt:
            :meth:`.app.Served.render`).

    Returns:
        The call (``max_completion_tokens``, else ``max_tokens``; neither: up to max_model_len, as vLLM).

    Raises:
        OpenAIError: 400 naming the parameter at fault.
    """
    model = _model(body, CHAT_KEYS, "/v1/chat/completions")
    for name in ("tools", "functions"):
        if body.get(name):
            raise bad_value(name, "tools are not supported (use response_format with a JSON schema for structured "
                                  "output)")
    for name in ("tool_choice", "function_call"):
        if body.get(name) not in (None, "none", "auto"):
            raise bad_value(name, "tools are not supported")
    modalities = body.get("modalities")
    if modalities not in (None, ["text"]) or body.get("audio"):
        raise bad_value("modalities" if modalities not in (None, ["text"]) else "audio", "only text is served")
    call = GenerateCall(chat=True, model=model, prompt=render(chat_messages(body)))
    if _typed(body, "logprobs", bool, False):
        top = _typed(body, "top_logprobs", int, 0)
        if not 0 <= top <= MAX_TOP_LOGPROBS:
            raise bad_value("top_logprobs", f"must be in [0, {MAX_TOP_LOGPROBS}], got {top}")
        call.logprobs = top
    elif body.get("top_logprobs"):
        raise bad_value("top_logprobs", "needs 'logprobs': true")
    name = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    _common(body, call, _typed(body, name, int), name)
    return call
