"""OpenAI request bodies -> generate inputs, and the 400s that name the parameter (spec_decode.openai_api.params)."""

import json

import numpy as np
import pytest

from spec_decode.openai_api.errors import from_triton
from spec_decode.openai_api.params import parse_chat, parse_completion


def render(messages):
    return "|".join(f"{m['role']}:{m['content']}" for m in messages) + "|assistant:"


def refused(fn, body, param, status=400):
    with pytest.raises(Exception) as ei:
        fn(body)
    e = ei.value
    assert e.status == status and e.param == param, (e.status, e.param, e.message)
    assert e.body()["error"]["param"] == param and e.body()["error"]["type"] == "invalid_request_error"
    return e


def test_completion_maps_every_control_to_generate_inputs():
    call = parse_completion({"model": "m", "prompt": "def f():", "max_tokens": 7, "temperature": 0.5, "top_p": 0.9,
                             "seed": 3, "stop": "\n\n", "presence_penalty": 0.1, "frequency_penalty": 0.2,
                             "top_k": 5, "min_tokens": 2, "repetition_penalty": 1.1, "speculative_method": "ngram",
                             "num_draft_tokens": 3, "draft_tree": False, "tree_top_k": 2, "tree_depth": 3,
                             "logprobs": 2, "stream": True,
                             "stream_options": {"include_usage": True}, "user": "ignored"})
    i = call.inputs
    assert call.prompt == "def f():" and not call.chat and call.stream and call.include_usage and call.logprobs == 2
    assert i["max_tokens"].dtype == np.int32 and i["max_tokens"].tolist() == [7]
    assert i["random_seed"].dtype == np.uint64 and i["random_seed"].tolist() == [3]
    assert i["stop_words"].tolist() == [b"\n\n"] and i["speculative_method"].tolist() == [b"ngram"]
    assert i["temperature"].dtype == np.float32 and i["top_k"].tolist() == [5] and i["num_draft_tokens"].tolist() == [3]
    assert i["return_log_probs"].tolist() == [True] and i["top_logprobs"].tolist() == [2]
    assert i["draft_tree"].tolist() == [False] and i["tree_top_k"].tolist() == [2] and i["tree_depth"].tolist() == [3]
    assert i["tree_top_k"].dtype == np.int32 and i["draft_tree"].dtype == np.bool_
    whole = parse_completion({"model": "m", "prompt": "x", "tree_top_k": 3.0, "max_tokens": 5.0}).inputs
    assert whole["tree_top_k"].tolist() == [3] and whole["max_tokens"].tolist() == [5]  # a whole float is an integer
    assert "user" not in i and "stream" not in i


def test_completion_defaults_to_16_tokens_and_chat_to_no_limit():
    assert parse_completion({"model": "m", "prompt": "x"}).inputs["max_tokens"].tolist() == [16]
    chat = parse_chat({"model": "m", "messages": [{"role": "user", "content": "hi"}]}, render)
    assert "max_tokens" not in chat.inputs and chat.prompt == "user:hi|assistant:"
    c2 = parse_chat({"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 9,
                     "max_completion_tokens": 4}, render)
    assert c2.inputs["max_tokens"].tolist() == [4]


def test_chat_content_parts_developer_role_and_logprobs():
    call = parse_chat({"model": "m", "messages": [
        {"role": "developer", "content": "be brief"},
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}],
        "logprobs": True, "top_logprobs": 3}, render)
    assert call.prompt == "system:be brief|user:ab|assistant:" and call.logprobs == 3
    assert call.inputs["top_logprobs"].tolist() == [3]


def test_response_format_becomes_the_guide():
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    call = parse_completion({"model": "m", "prompt": "x", "response_format": {
        "type": "json_schema", "json_schema": {"name": "s", "schema": schema}}})
    assert call.inputs["guided_decoding_guide_type"].tolist() == [b"json_schema"]
    assert json.loads(call.inputs["guided_decoding_guide"][0]) == schema
    obj = parse_completion({"model": "m", "prompt": "x", "response_format": {"type": "json_object"}})
    assert obj.inputs["guided_decoding_guide_type"].tolist() == [b"json"]
    assert "guided_decoding_guide_type" not in parse_completion(
        {"model": "m", "prompt": "x", "response_format": {"type": "text"}}).inputs


def chat(**kw):
    return lambda extra: parse_chat({"model": "m", "messages": [{"role": "user", "content": "hi"}], **kw, **extra},
                                    render)


@pytest.mark.parametrize("extra,param", [
    ({"n": 2}, "n"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"logit_bias": {"1": 5}}, "logit_bias"),
    ({"temperature": "hot"}, "temperature"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_completion_tokens": -1}, "max_completion_tokens"),
    ({"seed": -1}, "seed"),
    ({"stop": [""]}, "stop"),
    ({"stream_options": {"include_usage": True}}, "stream_options"),
    ({"top_logprobs": 2}, "top_logprobs"),
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({"response_format": {"type": "xml"}}, "response_format"),
    ({"temprature": 0.5}, "temprature"),
    ({"modalities": ["audio"]}, "modalities"),
])
def test_chat_refuses_naming_the_parameter(extra, param):
    refused(chat(), extra, param)


@pytest.mark.parametrize("messages,param", [
    ([], "messages"),
    ([{"role": "tool", "content": "x"}], "messages[0].role"),
    ([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x"}}]}],
     "messages[0].content[0].type"),
    ([{"role": "user", "content": 5}], "messages[0].content"),
])
def test_chat_messages_refused_naming_the_element(messages, param):
    refused(lambda b: parse_chat(b, render), {"model": "m", "messages": messages}, param)


@pytest.mark.parametrize("body,param", [
    ({"prompt": "x"}, "model"),
    ({"model": "m", "prompt": ["a", "b"]}, "prompt"),
    ({"model": "m", "prompt": [1, 2, 3]}, "prompt"),
    ({"model": "m", "prompt": "x", "suffix": "y"}, "suffix"),
    ({"model": "m", "prompt": "x", "echo": True, "logprobs": 1}, "echo"),
    ({"model": "m", "prompt": "x", "logprobs": 30}, "logprobs"),
    ({"model": "m", "prompt": "x", "best_of": 3}, "best_of"),
])
def test_completion_refuses_naming_the_parameter(body, param):
    refused(parse_completion, body, param)


def test_generate_errors_name_the_openai_parameter():
    e = from_triton("in ensemble: invalid input 'random_seed': must be >= 0, got -1")
    assert (e.status, e.param) == (400, "seed") and "must be >= 0" in e.message
    e = from_triton("invalid input 'text_input': too long", prompt_param="messages")
    assert (e.status, e.param) == (400, "messages")
    e = from_triton("invalid input 'speculative_method': 'foo' is not one of none, ngram")
    assert (e.status, e.param) == (400, "speculative_method")
    assert from_triton("Stub process 'generate_0_0' is not healthy.", unavailable=True).status == 503
    assert from_triton("CUDA error").status == 500


@pytest.mark.parametrize("extra,param", [
    ({"temperature": 10 ** 400}, "temperature"),
    ({"top_k": 2 ** 32 + 1}, "top_k"),
    ({"num_draft_tokens": 2 ** 32 + 9}, "num_draft_tokens"),
    ({"min_tokens": 2 ** 40}, "min_tokens"),
    ({"max_tokens": 10 ** 12}, "max_tokens"),
    ({"stop_token_ids": [2 ** 40]}, "stop_token_ids"),
])
def test_numbers_out_of_their_wire_type_are_refused_not_wrapped(extra, param):
    e = refused(chat(), extra, param)
    assert str(list(extra.values())[0])[:8] in e.message or "too large" in e.message or "integers" in e.message


def test_a_64_bit_seed_is_accepted():
    call = parse_completion({"model": "m", "prompt": "x", "seed": 2 ** 64 - 1})
    assert call.inputs["random_seed"].tolist() == [2 ** 64 - 1]
