"""OpenAI response objects built from ``generate``'s steps: completions, chat completions, their streamed chunks,
usage and log-probs, shaped as OpenAI's API reference gives them (``text_completion``, ``chat.completion``,
``chat.completion.chunk``).
"""

from __future__ import annotations

import codecs
import json
import math
import time
import uuid
from collections.abc import Callable

from .params import GenerateCall
from .token_bytes import token_string
from .triton import StepOutput

# generate's finish reasons -> OpenAI's ("stop": EOS, end id or stop word; "length": max_tokens or max_model_len)
_FINISH = {"stop": "stop", "length": "length"}


def finish_reason(reason: str | None) -> str | None:
    """OpenAI's ``finish_reason`` for generate's (None while running)."""
    return None if reason is None else _FINISH.get(reason, "stop")


class Reply:
    """The parts of one OpenAI response shared by its chunks: id, creation time, model, and the running counts.

    Args:
        call: the request.
        token_bytes: token id -> the token's own bytes, or None for a special token that the content skips
            (:func:`.token_bytes.token_bytes_reader`), for log-probs.
        token_text: token id -> its text (the tokenizer's decoding of that one token): a special token's ``token``.
    """

    def __init__(self, call: GenerateCall, token_bytes: Callable[[int], bytes | None],
                 token_text: Callable[[int], str]):
        self.call = call
        self.id = ("chatcmpl-" if call.chat else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())
        self.token_bytes = token_bytes
        self.token_text = token_text
        self.prompt_tokens = 0
        self.completion_tokens = 0
        self.text_offset = len(call.prompt) if call.echo else 0  # completions' logprobs.text_offset (characters)
        self._utf8 = codecs.getincrementaldecoder("utf-8")("replace")  # the characters the tokens so far complete

    def count(self, step: StepOutput) -> None:
        """Add one step to the usage counts."""
        if step.num_input_tokens is not None:
            self.prompt_tokens = step.num_input_tokens
        self.completion_tokens += len(step.token_ids)

    def usage(self) -> dict:
        """``usage``: prompt, completion and total token counts."""
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
                "total_tokens": self.prompt_tokens + self.completion_tokens}

    # -- log-probs ---------------------------------------------------------------------------------------------------

    def _token(self, token_id: int) -> tuple[str, list[int] | None]:
        """A token's ``token`` string and ``bytes``: its own bytes (a part of a UTF-8 character included, never the
        replacement character), the string by OpenAI's convention (:func:`.token_bytes.token_string`); a special
        token: its text and no bytes (null)."""
        data = self.token_bytes(int(token_id))
        if data is None:
            return self.token_text(int(token_id)), None
        return token_string(data), list(data)

    def _alternatives(self, step: StepOutput, i: int) -> list[tuple[str, list[int] | None, float]]:
        if step.top_ids is None or step.top_log_probs is None or self.call.logprobs in (None, 0):
            return []
        ids, lps = step.top_ids[i], step.top_log_probs[i]
        return [(*self._token(int(t)), _finite(float(lp))) for t, lp in zip(ids, lps) if t >= 0]

    def logprobs(self, step: StepOutput) -> dict | None:
        """The step's ``logprobs`` object (chat: ``{"content": [...]}``; completions: ``tokens``, ``token_logprobs``,
        ``top_logprobs``, ``text_offset``), or None when the request asked for none.

        Each token's ``bytes`` are its own, so a response's concatenated ``bytes`` are its content's UTF-8;
        ``text_offset`` is the character index where the token's first byte falls (inside a character that an
        earlier token began, that character's index)."""
        if self.call.logprobs is None or step.log_probs is None:
            return None
        if self.call.chat:
            content = []
            for i, (tok, lp) in enumerate(zip(step.token_ids, step.log_probs)):
                text, data = self._token(tok)
                content.append({"token": text, "logprob": _finite(lp), "bytes": data,
                                "top_logprobs": [{"token": t, "logprob": a, "bytes": b}
                                                 for t, b, a in self._alternatives(step, i)]})
            return {"content": content}
        tokens, offsets, tops = [], [], []
        for i, tok in enumerate(step.token_ids):
            text, data = self._token(tok)
            tokens.append(text)
            offsets.append(self.text_offset)
            self.text_offset += len(self._utf8.decode(bytes(data or b"")))
            tops.append({t: a for t, _, a in self._alternatives(step, i)} if self.call.logprobs else None)
        return {"tokens": tokens, "token_logprobs": [_finite(x) for x in step.log_probs], "top_logprobs": tops,
                "text_offset": offsets}

    # -- whole responses and chunks ----------------------------------------------------------------------------------

    def whole(self, text: str, reason: str | None, logprobs: dict | None) -> dict:
        """The non-streamed response object."""
        if self.call.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": logprobs,
                      "finish_reason": finish_reason(reason)}
        else:
            choice = {"index": 0, "text": (self.call.prompt if self.call.echo else "") + text, "logprobs": logprobs,
                      "finish_reason": finish_reason(reason)}
        return {"id": self.id, "object": "chat.completion" if self.call.chat else "text_completion",
                "created": self.created, "model": self.call.model, "system_fingerprint": None, "choices": [choice],
                "usage": self.usage()}

    def chunk(self, text: str | None, reason: str | None = None, logprobs: dict | None = None,
              role: bool = False) -> str:
        """One server-sent event carrying a chunk: ``text`` (None: no content key), the finish reason on the last,
        ``role`` on chat's first."""
        if self.call.chat:
            delta: dict = {"role": "assistant"} if role else {}
            if text is not None:
                delta["content"] = text
            choice = {"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason(reason)}
        else:
            choice = {"index": 0, "text": text or "", "logprobs": logprobs, "finish_reason": finish_reason(reason)}
        obj = {"id": self.id, "object": "chat.completion.chunk" if self.call.chat else "text_completion",
               "created": self.created, "model": self.call.model, "system_fingerprint": None, "choices": [choice]}
        if self.call.include_usage:
            obj["usage"] = None
        return sse(obj)

    def usage_chunk(self) -> str:
        """The last chunk of a stream with ``stream_options.include_usage``: no choices, the usage."""
        return sse({"id": self.id, "object": "chat.completion.chunk" if self.call.chat else "text_completion",
                    "created": self.created, "model": self.call.model, "system_fingerprint": None, "choices": [],
                    "usage": self.usage()})


def merge_logprobs(parts: list[dict], chat: bool) -> dict | None:
    """The steps' ``logprobs`` objects joined into the whole response's (None when there are none)."""
    if not parts:
        return None
    if chat:
        return {"content": [c for p in parts for c in p["content"]]}
    return {k: [x for p in parts for x in p[k]] for k in ("tokens", "token_logprobs", "top_logprobs", "text_offset")}


def _finite(x: float) -> float:
    """A log-prob JSON can carry: -inf (a token the processors ruled out) as -9999.0, as vLLM does."""
    return x if math.isfinite(x) else -9999.0


def sse(obj: dict | str) -> str:
    """One server-sent event: ``data: <json>`` (or the literal ``[DONE]``) and a blank line."""
    return f"data: {obj if isinstance(obj, str) else json.dumps(obj, separators=(',', ':'))}\n\n"
