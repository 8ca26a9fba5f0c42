"""The OpenAI app's routes, streaming, errors and API key, with a stand-in for Triton's generate (the real server:
tests/integration/test_openai.py)."""

import json

import numpy as np
import pytest
from starlette.testclient import TestClient

from spec_decode.openai_api.app import Served, build_app
from spec_decode.openai_api.errors import OpenAIError
from spec_decode.openai_api.triton import StepOutput


class Tokenizer:
    chat_template = "x"

    def decode(self, ids):
        return "".join(f"<{i}>" for i in ids)

    def apply_chat_template(self, messages, tokenize, add_generation_prompt):
        return "".join(m["content"] for m in messages) + "=>"


class FakeGenerate:
    """generate's responses for every request: steps of (text, ids), the last with finish_reason."""

    def __init__(self, steps=(("Hel", [1, 2]), ("lo", [3])), finish="length", ready=True, error=None):
        self.steps, self.finish, self.is_ready, self.error = steps, finish, ready, error
        self.calls = []
        self.closed = 0

    async def ready(self):
        return self.is_ready

    async def max_model_len(self):
        return 99

    async def close(self):
        pass

    async def stream(self, prompt, inputs, prompt_param="prompt"):
        self.calls.append((prompt, inputs))
        if self.error is not None:
            raise self.error
        try:
            for j, (text, ids) in enumerate(self.steps):
                last = j == len(self.steps) - 1
                lps = [-0.5] * len(ids) if "return_log_probs" in inputs else None
                top = inputs.get("top_logprobs")
                k = int(top[0]) if top is not None else 0
                yield StepOutput(text, ids, lps, np.tile(np.arange(k, dtype=np.int32), (len(ids), 1)) if k else None,
                                 np.full((len(ids), k), -1.0, np.float32) if k else None,
                                 self.finish if last else None, num_input_tokens=4)
        finally:
            self.closed += 1


def client(gen=None, **kw):
    served = Served(gen or FakeGenerate(), Tokenizer(), ("m",), **kw)
    return TestClient(build_app(served)), served


def events(text):
    out = [line[6:] for line in text.split("\n") if line.startswith("data: ")]
    assert out[-1] == "[DONE]"
    return [json.loads(x) for x in out[:-1]]


def test_models_and_unknown_model():
    c, _ = client()
    r = c.get("/v1/models")
    assert r.status_code == 200 and [m["id"] for m in r.json()["data"]] == ["m"]
    assert c.get("/v1/models/m").json()["id"] == "m"
    r = c.post("/v1/completions", json={"model": "other", "prompt": "x"})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    assert r.json()["error"]["param"] == "model"
    r = c.get("/v1/nothing")
    assert r.status_code == 404 and "error" in r.json()


def test_completion_whole_text_usage_and_finish_reason():
    gen = FakeGenerate()
    c, _ = client(gen)
    r = c.post("/v1/completions", json={"model": "m", "prompt": "Say", "max_tokens": 3})
    body = r.json()
    assert r.status_code == 200 and body["object"] == "text_completion"
    assert body["choices"][0]["text"] == "Hello" and body["choices"][0]["finish_reason"] == "length"
    assert body["usage"] == {"prompt_tokens": 4, "completion_tokens": 3, "total_tokens": 7}
    assert gen.calls[0][0] == "Say" and gen.calls[0][1]["max_tokens"].tolist() == [3]


def test_chat_stream_one_chunk_per_step_then_usage_and_done():
    gen = FakeGenerate(steps=(("Hel", [1, 2]), ("lo", [3]), ("!", [4])), finish="stop")
    c, _ = client(gen)
    r = c.post("/v1/chat/completions", json={"model": "m", "messages": [{"role": "user", "content": "hi"}],
                                             "stream": True, "stream_options": {"include_usage": True}})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    ev = events(r.text)
    assert ev[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    deltas = [e["choices"][0]["delta"].get("content") for e in ev[1:-1]]
    assert deltas == ["Hel", "lo", "!"]  # one chunk per step, the step's tokens together
    assert ev[-2]["choices"][0]["finish_reason"] == "stop" and ev[-1]["choices"] == []
    assert ev[-1]["usage"] == {"prompt_tokens": 4, "completion_tokens": 4, "total_tokens": 8}
    assert all(e["usage"] is None for e in ev[:-1]) and gen.calls[0][0] == "hi=>"
    assert gen.calls[0][1]["max_tokens"].tolist() == [99]  # no limit given: max_model_len


def test_logprobs_in_both_shapes():
    c, _ = client()
    r = c.post("/v1/chat/completions", json={"model": "m", "messages": [{"role": "user", "content": "hi"}],
                                             "logprobs": True, "top_logprobs": 2}).json()
    content = r["choices"][0]["logprobs"]["content"]
    assert [x["token"] for x in content] == ["<1>", "<2>", "<3>"] and content[0]["logprob"] == -0.5
    assert [t["token"] for t in content[0]["top_logprobs"]] == ["<0>", "<1>"]
    assert content[0]["bytes"] == list(b"<1>")
    r = c.post("/v1/completions", json={"model": "m", "prompt": "x", "logprobs": 1}).json()
    lp = r["choices"][0]["logprobs"]
    assert lp["tokens"] == ["<1>", "<2>", "<3>"] and lp["text_offset"] == [0, 3, 6]
    assert lp["top_logprobs"][0] == {"<0>": -1.0} and lp["token_logprobs"] == [-0.5] * 3


def test_api_key_is_required_when_set():
    c, _ = client(api_key="sekret")
    assert c.get("/v1/models").status_code == 401
    r = c.get("/v1/models", headers={"Authorization": "Bearer wrong"})
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    assert c.get("/v1/models", headers={"Authorization": "Bearer sekret"}).status_code == 200
    assert c.get("/health").status_code == 200  # health checks need no key


def test_body_too_large_and_not_json():
    c, _ = client(max_body_bytes=100)
    r = c.post("/v1/completions", content=json.dumps({"model": "m", "prompt": "x" * 200}),
               headers={"Content-Type": "application/json"})
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
    r = c.post("/v1/completions", content=b"{not json", headers={"Content-Type": "application/json"})
    assert r.status_code == 400


@pytest.mark.parametrize("stream", [False, True])
def test_generate_errors_keep_their_status_before_streaming(stream):
    gen = FakeGenerate(error=OpenAIError(400, "'seed': must be >= 0", param="seed"))
    c, _ = client(gen)
    r = c.post("/v1/completions", json={"model": "m", "prompt": "x", "stream": stream})
    assert r.status_code == 400 and r.json()["error"]["param"] == "seed"
    gen.error = OpenAIError(503, "not ready", code="service_unavailable")
    assert c.post("/v1/completions", json={"model": "m", "prompt": "x", "stream": stream}).status_code == 503


def test_health_follows_triton():
    gen = FakeGenerate(ready=False)
    c, _ = client(gen)
    assert c.get("/health").status_code == 503
    gen.is_ready = True
    assert c.get("/health").status_code == 200


def test_echo_puts_the_prompt_first():
    c, _ = client()
    r = c.post("/v1/completions", json={"model": "m", "prompt": "Say", "echo": True}).json()
    assert r["choices"][0]["text"] == "SayHello"
    ev = events(c.post("/v1/completions", json={"model": "m", "prompt": "Say", "echo": True, "stream": True}).text)
    assert "".join(e["choices"][0]["text"] for e in ev) == "SayHello"


@pytest.mark.parametrize("raw,what", [
    (b'{"model": "m", "prompt": "a\\ud800b"}', "surrogate"),
    (b'{"model": "\\ud800", "prompt": "x"}', "surrogate"),
    (b"[" * 100000 + b"]" * 100000, "nested"),
])
def test_bodies_python_cannot_carry_are_400_not_500(raw, what):
    c, _ = client()
    r = c.post("/v1/completions", content=raw, headers={"Content-Type": "application/json"})
    assert r.status_code == 400 and what in r.json()["error"]["message"]
