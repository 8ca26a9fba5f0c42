"""The OpenAI-compatible frontend (spec_decode.openai_api) against the real tritonserver (fixture ``server``),
through the official ``openai`` client, sync and async, as users call it."""

import asyncio
import json
import os
import re
import signal
import time

import openai
import pytest
import requests
import torch

from client.datasets import humaneval_prompts
from client.generate import stream_generate
from client.metrics import value, wait_for
from spec_decode.launcher import free_ports
from spec_decode.launcher.frontend import OpenAIFrontend
from tests.integration.test_trust import CACHES, _idle

MESSAGES = [{"role": "user", "content": "Write a Python function that reverses a string."}]
N = 24  # tokens per greedy check


@pytest.fixture(scope="module")
def frontend(server, tmp_path_factory):
    """The frontend on a free port, talking to the session's server (as the launcher starts it)."""
    fe = OpenAIFrontend(server.grpc_url, free_ports(1)[0], log_path=tmp_path_factory.mktemp("openai") / "fe.log")
    fe.start()
    try:
        fe.wait_ready(120)
        yield fe
    finally:
        fe.stop()


@pytest.fixture(scope="module")
def sync_client(frontend):
    return openai.OpenAI(base_url=frontend.url + "/v1", api_key="unused", max_retries=0, timeout=300)


@pytest.fixture(scope="module")
def templated(real_tokenizer):
    return real_tokenizer.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)


def target_greedy(model, tokenizer, prompt, n):
    """The target's own greedy continuation (transformers, in process): ids up to EOS."""
    ids = tokenizer(prompt, return_tensors="pt")["input_ids"]
    with torch.inference_mode():
        out = model.generate(ids, max_new_tokens=n, do_sample=False)[0, ids.shape[1]:].tolist()
    eos = tokenizer.eos_token_id
    return out[: out.index(eos)] if eos in out else out


@pytest.fixture(scope="module")
def chat_reference(real_model, real_tokenizer, templated):
    return target_greedy(real_model, real_tokenizer, templated, N)


def test_models_lists_the_target(sync_client, frontend):
    assert [m.id for m in sync_client.models.list()] == [frontend.served_name] == ["SmolLM2-135M-Instruct"]


# one of each kind (plain, model-free, draft LM, hidden-state head, Medusa): every method through generate is
# tests/integration/test_server.py's; the OpenAI layer passes speculative_method through
@pytest.mark.parametrize("method", ("none", "suffix", "draft", "eagle3", "medusa"))
def test_chat_greedy_equals_the_targets_greedy_for_each_kind_of_method(sync_client, frontend, real_tokenizer, method,
                                                                chat_reference):
    r = sync_client.chat.completions.create(model=frontend.served_name, messages=MESSAGES, max_tokens=N,
                                            temperature=0, extra_body={"speculative_method": method,
                                                                       "num_draft_tokens": 4})
    assert r.choices[0].message.content == real_tokenizer.decode(chat_reference, skip_special_tokens=True), method
    assert r.usage.completion_tokens == len(chat_reference)


def test_streamed_deltas_join_to_the_whole_and_usage_counts_tokens(sync_client, frontend, real_tokenizer, templated,
                                                                   chat_reference):
    kw = dict(model=frontend.served_name, messages=MESSAGES, max_completion_tokens=N, temperature=0,
              extra_body={"speculative_method": "draft"})
    whole = sync_client.chat.completions.create(**kw)
    chunks = list(sync_client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    deltas = [c.choices[0].delta.content for c in chunks if c.choices and c.choices[0].delta.content]
    assert "".join(deltas) == whole.choices[0].message.content
    assert any(len(real_tokenizer(d, add_special_tokens=False)["input_ids"]) > 1 for d in deltas)  # a step's tokens
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(chat_reference)
    n_prompt = len(real_tokenizer(templated)["input_ids"])
    assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens == n_prompt
    assert whole.usage.total_tokens == n_prompt + len(chat_reference)
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == whole.choices[0].finish_reason


def test_async_completions_streamed_and_not_equal_the_targets_greedy(frontend, real_model, real_tokenizer):
    prompt = humaneval_prompts(1)[0]
    ref = real_tokenizer.decode(target_greedy(real_model, real_tokenizer, prompt, 16), skip_special_tokens=True)

    async def run():
        c = openai.AsyncOpenAI(base_url=frontend.url + "/v1", api_key="unused", max_retries=0, timeout=300)
        whole = await c.completions.create(model=frontend.served_name, prompt=prompt, max_tokens=16, temperature=0)
        stream = await c.completions.create(model=frontend.served_name, prompt=prompt, max_tokens=16, temperature=0,
                                            stream=True, extra_body={"speculative_method": "suffix"})
        parts = [ch.choices[0].text async for ch in stream]
        await c.close()
        return whole, parts

    whole, parts = asyncio.run(run())
    assert whole.choices[0].text == "".join(parts) == ref
    assert whole.choices[0].finish_reason == "length" and whole.usage.completion_tokens == 16


def test_seed_reproduces_a_sampled_completion(sync_client, frontend):
    kw = dict(model=frontend.served_name, messages=MESSAGES, max_tokens=16, temperature=1.0, top_p=0.95)
    a, b = (sync_client.chat.completions.create(seed=1234, **kw).choices[0].message.content for _ in range(2))
    assert a == b
    others = {sync_client.chat.completions.create(seed=s, **kw).choices[0].message.content for s in (1, 2, 3)}
    assert len(others | {a}) > 1  # sampling does sample


def test_response_format_json_schema_parses_and_validates(sync_client, frontend):
    schema = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
              "required": ["name", "age"], "additionalProperties": False}
    r = sync_client.chat.completions.create(
        model=frontend.served_name, max_tokens=48, temperature=0,
        messages=[{"role": "user", "content": "Give a person's name and age as JSON."}],
        response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": schema}})
    obj = json.loads(r.choices[0].message.content)
    assert set(obj) == {"name", "age"} and isinstance(obj["name"], str) and isinstance(obj["age"], int)
    r = sync_client.completions.create(model=frontend.served_name, prompt="A JSON list of three colours:",
                                       max_tokens=32, temperature=0, extra_body={"response_format":
                                                                                 {"type": "json_object"}})
    json.loads(r.choices[0].text)


def test_logprobs_equal_generates(sync_client, frontend, server, templated):
    r = sync_client.chat.completions.create(model=frontend.served_name, messages=MESSAGES, max_tokens=12,
                                            temperature=0, logprobs=True, top_logprobs=3)
    got = r.choices[0].logprobs.content
    direct = stream_generate(server.grpc_url, templated, 12, return_log_probs=True, top_logprobs=3)
    assert [x.logprob for x in got] == pytest.approx(direct.stats["output_log_probs"], abs=1e-6)
    assert len(got) == len(direct.output_ids) and all(len(x.top_logprobs) == 3 for x in got)
    assert all(x.top_logprobs[0].logprob >= x.top_logprobs[1].logprob for x in got)
    assert "".join(x.token for x in got) == r.choices[0].message.content


FIG_PROMPT = "List: fig, fig, fig, fig,"  # the target answers " fig, fig, fig, ..."
FIG_CHAT = [{"role": "user", "content": "Say fig, fig, fig, fig, fig."}]  # an answer with " of" twice
EMOJI_CHAT = [{"role": "user", "content": "Write a smiley emoji and a rocket emoji."}]  # emoji split over tokens


def _cut(model, tokenizer, prompt, stop, n, first_past=False, min_tokens=0):
    """(min_tokens, text, token count) of the plain decoder's stop on the target's greedy answer; with ``first_past``,
    min_tokens is just past the first occurrence (so an occurrence completes before it: the bug's case)."""
    from tests.helpers import plain_stop_cut

    ids = tokenizer(prompt)["input_ids"]
    out = target_greedy(model, tokenizer, prompt, n)
    if first_past:
        first = plain_stop_cut(tokenizer, ids, out, stop, 0)
        assert first is not None, tokenizer.decode(out)
        min_tokens = first[0] + 1
    cut = plain_stop_cut(tokenizer, ids, out, stop, min_tokens)
    assert cut is not None, (tokenizer.decode(out), min_tokens)
    return min_tokens, cut[1], cut[0]


@pytest.mark.parametrize("method", ["none", "suffix"])
def test_stop_under_min_tokens_cuts_where_plain_decoding_does(sync_client, frontend, real_model, real_tokenizer,
                                                              method):
    """Issue 41 (vLLM #21987) through both endpoints, streamed and not: the first stop word completed at or after the
    min_tokens-th token ends the answer, as plain decoding cuts it, for the baseline and a method at k = 8."""
    extra = {"speculative_method": method, "num_draft_tokens": 8}
    for mt in (4, 6, 9):
        _, text, n = _cut(real_model, real_tokenizer, FIG_PROMPT, ["fig"], 16, min_tokens=mt)
        kw = dict(model=frontend.served_name, prompt=FIG_PROMPT, max_tokens=16, temperature=0, stop="fig",
                  extra_body={**extra, "min_tokens": mt})
        whole = sync_client.completions.create(**kw)
        assert (whole.choices[0].text, whole.choices[0].finish_reason) == (text, "stop"), mt
        assert whole.usage.completion_tokens == n
        parts = list(sync_client.completions.create(stream=True, **kw))
        assert "".join(p.choices[0].text for p in parts) == text and parts[-1].choices[0].finish_reason == "stop"
    templated = real_tokenizer.apply_chat_template(FIG_CHAT, tokenize=False, add_generation_prompt=True)
    mt, text, n = _cut(real_model, real_tokenizer, templated, [" of"], 24, first_past=True)
    kw = dict(model=frontend.served_name, messages=FIG_CHAT, max_tokens=24, temperature=0, stop=[" of"],
              extra_body={**extra, "min_tokens": mt})
    whole = sync_client.chat.completions.create(**kw)
    assert (whole.choices[0].message.content, whole.choices[0].finish_reason) == (text, "stop")
    assert whole.usage.completion_tokens == n and text.count(" of") == 1
    chunks = list(sync_client.chat.completions.create(stream=True, **kw))
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == text
    assert chunks[-1].choices[0].finish_reason == "stop"


def _bytes_of(token: str) -> bytes:
    """A completions ``token`` string back to bytes (OpenAI's ``bytes:`` form: ``\\xhh`` for stray bytes)."""
    if not token.startswith("bytes:"):
        return token.encode()
    parts = re.split(r"\\x([0-9a-f]{2})", token[len("bytes:"):])
    return b"".join(bytes([int(p, 16)]) if i % 2 else p.encode() for i, p in enumerate(parts))


def _check_entry(e):
    """A chat log-prob entry: bytes its own (no replacement character), ``token`` by OpenAI's convention."""
    data = bytes(e.bytes)
    assert data != "\ufffd".encode()
    try:
        assert e.token == data.decode()
    except UnicodeDecodeError:
        assert e.token.startswith("bytes:") and _bytes_of(e.token) == data


def test_logprob_bytes_of_split_characters_rebuild_the_content(sync_client, frontend, real_tokenizer):
    """Issue 41 (vLLM #27300): an answer of emoji, each split over tokens; with logprobs and top_logprobs 2, streamed
    and not, every entry's and alternative's bytes are the token's own and the entries' bytes join into the content's
    UTF-8; /v1/completions' tokens (``bytes:`` form) rebuild its text the same way."""
    kw = dict(model=frontend.served_name, messages=EMOJI_CHAT, max_tokens=12, temperature=0, logprobs=True,
              top_logprobs=2, extra_body={"speculative_method": "suffix"})
    whole = sync_client.chat.completions.create(**kw)
    chunks = list(sync_client.chat.completions.create(stream=True, **kw))
    content = whole.choices[0].message.content
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == content and content
    assert any(ord(ch) > 0xFFFF for ch in content), content  # the answer holds characters split over tokens
    for entries in (whole.choices[0].logprobs.content,
                    [e for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]):
        assert b"".join(bytes(e.bytes) for e in entries) == content.encode()
        assert any(e.token.startswith("bytes:") for e in entries)
        for e in entries:
            _check_entry(e)
            assert len(e.top_logprobs) == 2 and e.top_logprobs[0].bytes == e.bytes  # greedy: top-1 is the token
            for alt in e.top_logprobs:
                _check_entry(alt)
    templated = real_tokenizer.apply_chat_template(EMOJI_CHAT, tokenize=False, add_generation_prompt=True)
    ckw = dict(model=frontend.served_name, prompt=templated, max_tokens=12, temperature=0, logprobs=2)
    done = sync_client.completions.create(**ckw)
    parts = list(sync_client.completions.create(stream=True, **ckw))
    assert done.choices[0].text == content
    for tokens, tops in ((done.choices[0].logprobs.tokens, done.choices[0].logprobs.top_logprobs),
                         ([t for p in parts if p.choices[0].logprobs for t in p.choices[0].logprobs.tokens],
                          [t for p in parts if p.choices[0].logprobs for t in p.choices[0].logprobs.top_logprobs])):
        assert b"".join(_bytes_of(t) for t in tokens) == content.encode()
        assert all(t in top for t, top in zip(tokens, tops))


def test_the_draft_tree_controls_are_taken_and_output_stays_the_targets(sync_client, frontend, real_tokenizer,
                                                                      chat_reference):
    """draft_tree, tree_top_k and tree_depth ride in the body as generate's inputs of those names."""
    for shape in ({"draft_tree": False}, {"draft_tree": True, "tree_top_k": 2, "tree_depth": 2}):
        r = sync_client.chat.completions.create(model=frontend.served_name, messages=MESSAGES, max_tokens=N,
                                                temperature=0, extra_body={"speculative_method": "eagle3",
                                                                           "num_draft_tokens": 6, **shape})
        assert r.choices[0].message.content == real_tokenizer.decode(chat_reference, skip_special_tokens=True), shape


@pytest.mark.parametrize("kw,status,param", [
    ({"temperature": -1.0}, 400, "temperature"),
    ({"extra_body": {"tree_top_k": 11}}, 400, "tree_top_k"),
    ({"n": 2}, 400, "n"),
    ({"extra_body": {"speculative_method": "bogus"}}, 400, "speculative_method"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}]}, 400, "tools"),
    ({"model": "gpt-4o"}, 404, "model"),
])
def test_errors_name_the_parameter(sync_client, frontend, kw, status, param):
    args = dict(model=frontend.served_name, messages=MESSAGES, max_tokens=4) | kw
    with pytest.raises(openai.APIStatusError) as ei:
        sync_client.chat.completions.create(**args)
    assert ei.value.status_code == status and ei.value.body["param"] == param, ei.value.body


def test_body_too_large_is_413(frontend):
    r = requests.post(frontend.url + "/v1/completions", data=b"{" + b" " * (5 << 20) + b"}",
                      headers={"Content-Type": "application/json"}, timeout=60)
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"


def test_a_client_that_disconnects_mid_stream_frees_the_caches(frontend, server):
    wait_for(server.metrics_url, _idle)
    body = {"model": frontend.served_name, "messages": MESSAGES, "max_tokens": 1000, "stream": True,
            "ignore_eos": True, "speculative_method": "draft"}  # extra controls at the body's top level
    with requests.post(frontend.url + "/v1/chat/completions", json=body, stream=True, timeout=120) as r:
        lines = r.iter_lines()
        got = [next(lines) for _ in range(6)]  # a few steps are in: the sequence holds its caches
        assert any(line.startswith(b"data: ") for line in got)
        wait_for(server.metrics_url, lambda s: value(s, "spec_decode_running_sequences") == 1
                 and value(s, "spec_decode_target_kv_cache_sequences") == 1
                 and value(s, "spec_decode_draft_kv_cache_sequences") == 1)
        t0 = time.monotonic()
    after = wait_for(server.metrics_url, _idle, timeout_s=30)  # the connection closed: the request is cancelled
    assert all(value(after, g) == 0 for g in CACHES) and time.monotonic() - t0 < 15


def test_a_client_that_leaves_during_a_long_prefill_is_cancelled_then(frontend, server, real_tokenizer):
    """Gone before the first event (the prompt still being prefilled): the request is cancelled at once, not after its
    first step."""
    import socket
    from urllib.parse import urlparse

    before = wait_for(server.metrics_url, _idle)
    prompt = "\n".join(f"# note {i}: the value of x{i} is {i * 7 % 13}" for i in range(120))  # ~1,500 tokens
    body = json.dumps({"model": frontend.served_name, "prompt": prompt, "max_tokens": 200, "stream": True,
                       "ignore_eos": True, "speculative_method": "none"}).encode()
    u = urlparse(frontend.url)
    with socket.create_connection((u.hostname, u.port)) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
        wait_for(server.metrics_url, lambda s: value(s, "spec_decode_running_sequences") == 1)
    t0 = time.monotonic()
    after = wait_for(server.metrics_url, _idle, timeout_s=30)
    assert time.monotonic() - t0 < 15
    emitted = [value(x, "spec_decode_emitted_tokens_total", method="none") for x in (before, after)]
    assert emitted[0] == emitted[1]  # cancelled while its prompt was prefilled: no token was generated for it
    assert value(after, "spec_decode_requests_total", method="none", finish_reason="cancelled") == value(
        before, "spec_decode_requests_total", method="none", finish_reason="cancelled") + 1


def test_triton_not_ready_is_503(real_model_dir, tmp_path):
    grpc_port, port = free_ports(2)  # nothing listens on grpc_port
    fe = OpenAIFrontend(f"127.0.0.1:{grpc_port}", port, log_path=tmp_path / "fe.log").start()
    try:
        fe._wait(120, ready=False)
        assert fe.health() == 503
        c = openai.OpenAI(base_url=fe.url + "/v1", api_key="x", max_retries=0)
        with pytest.raises(openai.APIStatusError) as ei:
            c.completions.create(model=fe.served_name, prompt="hi", max_tokens=2)
        assert ei.value.status_code == 503
    finally:
        fe.stop()


def test_api_key_and_a_dead_frontend_comes_back(server, tmp_path):
    fe = OpenAIFrontend(server.grpc_url, free_ports(1)[0], api_key="s3cret", log_path=tmp_path / "fe.log").start()
    try:
        fe.wait_ready(120)
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=fe.url + "/v1", api_key="wrong", max_retries=0).models.list()
        ok = openai.OpenAI(base_url=fe.url + "/v1", api_key="s3cret", max_retries=0)
        assert [m.id for m in ok.models.list()] == [fe.served_name]
        old = fe.proc.pid
        os.kill(old, signal.SIGKILL)
        deadline = time.monotonic() + 90
        while not any(e.what == "restarted" for e in fe.events) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert [e.what for e in fe.events][:2] == ["died", "restarted"] and fe.proc.pid != old
        fe._wait(60)
        r = ok.completions.create(model=fe.served_name, prompt="def add(a, b):", max_tokens=4, temperature=0)
        assert r.usage.completion_tokens == 4
    finally:
        fe.stop()
