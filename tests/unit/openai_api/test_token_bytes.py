"""Each token's own bytes for OpenAI log-probs (issue 41, vLLM #27300): byte-level BPE (the real embedded tokenizer)
and byte-fallback tokenizers (Llama 2's decoder, built here), and the log-probs objects built from them."""

import numpy as np
import pytest
from tokenizers import Tokenizer, decoders, models, normalizers
from tokenizers.decoders import DecodeStream
from transformers import PreTrainedTokenizerFast

from spec_decode.openai_api.params import GenerateCall
from spec_decode.openai_api.responses import Reply
from spec_decode.openai_api.token_bytes import token_bytes_reader, token_string
from spec_decode.openai_api.triton import StepOutput

TEXT = " caf\u00e9 \U0001F600\U0001F680 na\u00efve \u4f60\u597d ab"


@pytest.fixture(scope="module")
def byte_fallback_tokenizer():
    """A Llama-2-style tokenizer: BPE with byte fallback (<0xhh> pieces), "▁" for spaces, Llama 2's decoder."""
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    for b in range(256):
        vocab[f"<0x{b:02X}>"] = len(vocab)
    for piece in ["\u2581", "a", "b", "c", "f", "n", "v", "e", "\u00e9", "\u2581c", "ca", "\u2581ca"]:
        vocab.setdefault(piece, len(vocab))
    bpe = models.BPE(vocab=vocab, merges=[("\u2581", "c"), ("c", "a"), ("\u2581", "ca")], unk_token="<unk>",
                     byte_fallback=True, fuse_unk=True)
    tk = Tokenizer(bpe)
    tk.normalizer = normalizers.Sequence([normalizers.Prepend("\u2581"), normalizers.Replace(" ", "\u2581")])
    tk.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(),
                                    decoders.Strip(" ", 1, 0)])
    return PreTrainedTokenizerFast(tokenizer_object=tk, bos_token="<s>", eos_token="</s>", unk_token="<unk>")


def _streamed(tok, prompt_ids, ids) -> str:
    """The text generate streams for ``ids`` after ``prompt_ids`` (tokenizers' DecodeStream)."""
    stream = DecodeStream(ids=list(prompt_ids), skip_special_tokens=True)
    return "".join(stream.step(tok.backend_tokenizer, t) or "" for t in ids)


@pytest.mark.parametrize("kind", ["byte_level", "byte_fallback"])
def test_token_bytes_rebuild_the_streamed_text(kind, real_tokenizer, byte_fallback_tokenizer):
    tok = real_tokenizer if kind == "byte_level" else byte_fallback_tokenizer
    prompt = tok("x", add_special_tokens=False)["input_ids"]
    ids = tok(TEXT, add_special_tokens=False)["input_ids"]
    read = token_bytes_reader(tok)
    parts = [read(t) for t in ids]
    assert b"".join(parts) == _streamed(tok, prompt, ids).encode()
    partial = [p for p in parts if p is not None and _invalid(p)]
    assert partial, "the text should split a character over tokens"
    assert all(token_string(p).startswith("bytes:") and "\\x" in token_string(p) for p in partial)
    assert all(p != "\ufffd".encode() for p in parts)
    assert read(tok.eos_token_id) is None  # a special token: not in the content


def _invalid(data: bytes) -> bool:
    try:
        data.decode()
        return False
    except UnicodeDecodeError:
        return True


def test_token_string_follows_openais_convention():
    assert token_string(b" caf\xc3\xa9") == " caf\u00e9"
    assert token_string(b"\xf0\x9f") == "bytes:\\xf0\\x9f"
    assert token_string(b" \xe4") == "bytes: \\xe4"


def _step(ids, tops):
    return StepOutput("", list(ids), [-0.5] * len(ids), np.array(tops, np.int32),
                      np.full((len(ids), len(tops[0])), -1.0, np.float32))


@pytest.mark.parametrize("chat", [True, False])
def test_log_probs_of_split_characters_rebuild_the_content(chat, real_tokenizer):
    """Chat's content entries and their top_logprobs, completions' tokens and top_logprobs: every entry's bytes are
    its token's own (never the replacement character's), the entries' bytes join into the content's UTF-8 over
    steps that split characters, and completions' text_offset indexes the content's characters."""
    tok = real_tokenizer
    ids = tok(" \U0001F600\U0001F680 ok", add_special_tokens=False)["input_ids"]
    read = token_bytes_reader(tok)
    call = GenerateCall(model="m", prompt="p", chat=chat, logprobs=2)
    reply = Reply(call, read, lambda t: tok.decode([t]))
    steps = [ids[:2], ids[2:5], ids[5:]]  # cut inside the emoji
    parts = [reply.logprobs(_step(s, [[t, ids[0]] for t in s])) for s in steps]
    content = " \U0001F600\U0001F680 ok"
    if chat:
        entries = [e for p in parts for e in p["content"]]
        assert b"".join(bytes(e["bytes"]) for e in entries) == content.encode()
        for e, t in zip(entries, ids):
            assert e["bytes"] == list(read(t)) and e["token"] == token_string(read(t))
            assert e["top_logprobs"][0]["bytes"] == e["bytes"] and e["top_logprobs"][1]["bytes"] == list(read(ids[0]))
        assert any(e["token"].startswith("bytes:") for e in entries)
    else:
        tokens = [t for p in parts for t in p["tokens"]]
        offsets = [o for p in parts for o in p["text_offset"]]
        assert tokens == [token_string(read(t)) for t in ids]
        assert all(list(p["top_logprobs"][0])[0] == tokens[0] for p in parts[:1])
        assert offsets[0] == 0 and offsets[-1] == content.index("ok") - 1 and offsets == sorted(offsets)
