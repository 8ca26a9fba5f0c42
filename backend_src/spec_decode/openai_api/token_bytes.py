"""Each token's own bytes, for OpenAI log-probs: ``bytes`` that rebuild the content, and ``token`` strings.

A byte-level BPE token (GPT-2, Llama 3, Qwen, SmolLM2) or a byte-fallback token (``<0xF0>`` in Llama 2, Mistral,
Gemma) often holds part of a UTF-8 character: an emoji is typically two to four tokens. Decoding such a token alone
gives the replacement character U+FFFD, whose bytes ``[239, 191, 189]`` are not the token's (vLLM #27300, PR #34875).
Here a token's bytes are read from its vocabulary piece through the tokenizer's decoder rules, so that the
concatenated ``bytes`` of a response's tokens are its content's UTF-8.

OpenAI's convention for the ``token`` string of a token that is not whole UTF-8 text: ``bytes:`` followed by the
token's bytes with every byte that is not part of a whole character written as ``\\xhh`` (e.g. ``bytes:\\xf0\\x9f``);
a token of whole characters is its text.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from functools import lru_cache
from typing import Any

_BYTE_FALLBACK = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")


def _gpt2_byte_decoder() -> dict[str, int]:
    """GPT-2's printable stand-in character for each byte, inverted (character -> byte), as byte-level BPE writes
    its vocabulary (openai/gpt-2 ``encoder.py`` ``bytes_to_unicode``; tokenizers' ``ByteLevel``)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


def _decoder_steps(tokenizer: Any) -> list[dict]:
    """The fast tokenizer's decoder as a flat list of steps (a ``Sequence`` unrolled); [] when it has none."""
    try:
        spec = json.loads(tokenizer.backend_tokenizer.to_str()).get("decoder") or {}
    except (AttributeError, ValueError):
        return []
    return list(spec.get("decoders") or []) if spec.get("type") == "Sequence" else [spec]


def token_bytes_reader(tokenizer: Any) -> Callable[[int], bytes | None]:
    """A function from token id to that token's own bytes (cached), for a Hugging Face fast tokenizer.

    Rules by decoder: ``ByteLevel`` maps each character of the vocabulary piece back to its byte; ``ByteFallback``
    reads ``<0xhh>`` pieces as the byte hh; ``Replace`` and ``Metaspace`` turn their marker (``▁``) into a space;
    added tokens that are not special are their content. A special token (skipped from the content, as generate's
    text skips it) has no bytes: None. A tokenizer with another decoder (WordPiece, ...) falls back to the UTF-8 of
    the token decoded alone.

    Args:
        tokenizer: a transformers fast tokenizer (``backend_tokenizer`` present).

    Returns:
        ``reader(token_id) -> bytes | None``; ids outside the vocabulary raise ``IndexError`` from the tokenizer or
        give None.
    """
    steps = _decoder_steps(tokenizer)
    kinds = {s.get("type") for s in steps}
    byte_level = _gpt2_byte_decoder() if "ByteLevel" in kinds else None
    replaces: list[tuple[str, str]] = []
    for s in steps:
        if s.get("type") == "Replace" and isinstance(s.get("pattern"), dict) and "String" in s["pattern"]:
            replaces.append((s["pattern"]["String"], s.get("content", "")))
        elif s.get("type") == "Metaspace":
            replaces.append((s.get("replacement", "\u2581"), " "))
    special = set(getattr(tokenizer, "all_special_ids", []) or [])
    added = {i: t for t, i in (tokenizer.get_added_vocab() or {}).items()} if hasattr(tokenizer, "get_added_vocab") \
        else {}

    @lru_cache(maxsize=1 << 17)
    def reader(token_id: int) -> bytes | None:
        if token_id in special:
            return None
        if token_id in added:
            return added[token_id].encode()
        if not steps:
            return tokenizer.decode([int(token_id)]).encode()
        piece = tokenizer.convert_ids_to_tokens(int(token_id))
        if piece is None:
            return None
        if byte_level is not None and all(c in byte_level for c in piece):
            return bytes(byte_level[c] for c in piece)
        if "ByteFallback" in kinds and (m := _BYTE_FALLBACK.match(piece)):
            return bytes([int(m.group(1), 16)])
        if replaces:
            for old, new in replaces:
                piece = piece.replace(old, new)
            return piece.encode()
        return tokenizer.decode([int(token_id)]).encode()

    return reader


def token_string(data: bytes) -> str:
    """The ``token`` string OpenAI gives a token of these bytes: its text when they are whole UTF-8 characters, else
    ``bytes:`` and the text with each stray byte as ``\\xhh`` (``b"\\xf0\\x9f"`` -> ``bytes:\\xf0\\x9f``)."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return "bytes:" + data.decode("utf-8", "backslashreplace")


__all__ = ["token_bytes_reader", "token_string"]
