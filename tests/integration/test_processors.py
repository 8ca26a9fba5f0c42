"""Logits processors, structured output and log-probs through the real server (fixture ``server``): each control
changes the output where it should, greedy output with the controls equals ``none``'s with the same controls for every
registered method at k = 1 and 4, JSON-schema output parses and validates for every method, min_tokens lifts the end
ids exactly at its index, a bad word that n-gram and suffix drafts copy never appears, top-N log-probs are sorted,
consistent and equal to ``none``'s, prompt log-probs are the model's, and bad values are refused naming the field."""

import json
import re

import numpy as np
import pytest
import requests
import torch
from tritonclient.utils import InferenceServerException

from client.datasets import humaneval_prompts
from client.generate import stream_generate
from spec_decode.proposers import METHODS

PROMPT = humaneval_prompts(2)[1]
N = 32
CONTROLS = dict(repetition_penalty=1.3, presence_penalty=0.6, frequency_penalty=0.4, min_tokens=24,
                bad_words=["print"], top_logprobs=3)
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 10},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120}},
          "required": ["name", "age"], "additionalProperties": False}
JSON_PROMPT = "Reply with a JSON object describing a person, with their name and age.\n"
_cache: dict = {}


def _none(server, prompt, n, **kw):
    """``none``'s output for these inputs (computed once per module)."""
    key = (prompt, n, json.dumps(kw, sort_keys=True))
    if key not in _cache:
        _cache[key] = stream_generate(server.grpc_url, prompt, n, speculative_method="none", **kw)
    return _cache[key]


@pytest.mark.parametrize("control, value", [("repetition_penalty", 1.6), ("presence_penalty", 2.0),
                                            ("frequency_penalty", 1.0), ("bad_words", ["print"])])
def test_each_control_changes_the_output(server, control, value):
    plain = _none(server, PROMPT, N)
    r = _none(server, PROMPT, N, **{control: value})
    assert r.output_ids != plain.output_ids
    if control == "bad_words":
        assert "print" in plain.text and "print" not in r.text


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("k", [1, 4])
def test_greedy_output_with_the_controls_equals_none_s(server, method, k):
    ref = _none(server, PROMPT, N, **CONTROLS)
    r = stream_generate(server.grpc_url, PROMPT, N, speculative_method=method, num_draft_tokens=k, **CONTROLS)
    assert r.output_ids == ref.output_ids
    assert "print" not in r.text and len(r.output_ids) >= 24
    np.testing.assert_allclose(r.stats["output_log_probs"], ref.stats["output_log_probs"], atol=2e-3)
    assert r.stats["output_token_ranks"] == ref.stats["output_token_ranks"]
    np.testing.assert_allclose(r.stats["top_log_probs"], ref.stats["top_log_probs"], atol=2e-3)
    for got, want, lps in zip(r.stats["top_log_prob_ids"], ref.stats["top_log_prob_ids"], ref.stats["top_log_probs"]):
        close = np.diff(lps) > -2e-3  # near-ties may swap order between the batched and the plain forward
        assert got == want or close.any()
    if method != "none":
        assert r.stats["num_draft_tokens_total"] > 0


def test_top_logprobs_are_sorted_and_consistent_with_output_log_probs(server):
    r = stream_generate(server.grpc_url, PROMPT, N, speculative_method="draft", num_draft_tokens=4, top_logprobs=5,
                        temperature=0.7, random_seed=3)
    s = r.stats
    assert len(s["top_log_probs"]) == len(s["top_log_prob_ids"]) == len(s["output_token_ranks"]) == len(r.output_ids)
    for tok, lp, rank, ids, lps in zip(r.output_ids, s["output_log_probs"], s["output_token_ranks"],
                                       s["top_log_prob_ids"], s["top_log_probs"]):
        assert lps == sorted(lps, reverse=True) and len(ids) == 5
        assert lp <= lps[0] + 1e-5 and rank >= 1
        if rank <= 5:
            assert ids[rank - 1] == tok and lps[rank - 1] == pytest.approx(lp, abs=1e-4)
        else:
            assert tok not in ids and lp <= lps[-1] + 1e-5


def test_prompt_logprobs_are_the_model_s(server, real_model, real_tokenizer):
    r = stream_generate(server.grpc_url, PROMPT, 4, speculative_method="suffix", prompt_logprobs=2)
    ids = real_tokenizer(PROMPT)["input_ids"]
    with torch.inference_mode():
        logp = torch.log_softmax(real_model(torch.tensor([ids])).logits[0, :-1].float(), -1)
    want = logp.gather(1, torch.tensor(ids[1:])[:, None])[:, 0].numpy()
    np.testing.assert_allclose(r.stats["prompt_log_probs"], want, atol=2e-3)
    assert np.asarray(r.stats["prompt_top_log_probs"]).shape == (len(ids) - 1, 2)
    np.testing.assert_allclose(np.asarray(r.stats["prompt_top_log_probs"])[:, 0], logp.max(-1).values.numpy(),
                               atol=2e-3)


@pytest.mark.parametrize("method", METHODS)
def test_json_schema_output_parses_and_validates(server, method):
    r = stream_generate(server.grpc_url, JSON_PROMPT, 96, speculative_method=method, num_draft_tokens=4,
                        guided_decoding_guide_type="json_schema", guided_decoding_guide=json.dumps(SCHEMA))
    assert r.stats["finish_reason"] == "stop", r.text
    value = json.loads(r.text)
    assert set(value) == {"name", "age"} and isinstance(value["name"], str) and len(value["name"]) <= 10
    assert isinstance(value["age"], int) and 0 <= value["age"] <= 120


def test_a_grammar_cut_by_max_tokens_ends_with_length_never_outside_it(server):
    r = stream_generate(server.grpc_url, "Count: ", 6, speculative_method="suffix", num_draft_tokens=4,
                        guided_decoding_guide_type="regex", guided_decoding_guide="(ab){40}")
    assert r.stats["finish_reason"] == "length" and len(r.output_ids) == 6
    assert re.fullmatch(r"(ab)*a?", r.text), r.text


def test_min_tokens_lifts_the_end_ids_exactly_at_its_index(server):
    prompt = "<|im_start|>user\nSay hi.<|im_end|>\n<|im_start|>assistant\n"
    plain = _none(server, prompt, 64)
    assert plain.stats["finish_reason"] == "stop"
    e = len(plain.output_ids)  # EOS came after e tokens
    for m in (e + 1, e + 6):
        r = stream_generate(server.grpc_url, prompt, 64, speculative_method="draft", num_draft_tokens=4, min_tokens=m)
        assert r.output_ids == _none(server, prompt, 64, min_tokens=m).output_ids
        assert len(r.output_ids) >= m


@pytest.mark.parametrize("method", ["ngram", "suffix"])
def test_a_bad_word_copied_by_drafts_never_appears(server, method):
    prompt = "apple banana cherry apple banana cherry apple banana cherry apple banana cherry apple"
    plain = stream_generate(server.grpc_url, prompt, 24, speculative_method=method, num_draft_tokens=4)
    assert "banana" in plain.text and plain.stats["num_accepted_tokens"] > 0  # the drafts copy it
    r = stream_generate(server.grpc_url, prompt, 24, speculative_method=method, num_draft_tokens=4,
                        bad_words=["banana"])
    assert "banana" not in r.text and r.output_ids == _none(server, prompt, 24, bad_words=["banana"]).output_ids


def test_stop_token_ids_end_generation_like_end_id(server):
    plain = _none(server, PROMPT, N)
    r = stream_generate(server.grpc_url, PROMPT, N, speculative_method="draft", stop_token_ids=[plain.output_ids[5]])
    assert r.output_ids == plain.output_ids[: plain.output_ids.index(plain.output_ids[5])]
    assert r.stats["finish_reason"] == "stop"


@pytest.mark.parametrize("params, field", [
    ({"n": 2}, "'n'"), ({"beam_width": 3}, "beam_width"), ({"num_return_sequences": 2}, "num_return_sequences"),
    ({"min_tokens": 9}, "min_tokens"), ({"repetition_penalty": -1.0}, "repetition_penalty"),
    ({"presence_penalty": 3.0}, "presence_penalty"), ({"frequency_penalty": -2.5}, "frequency_penalty"),
    ({"top_logprobs": 21}, "top_logprobs"), ({"prompt_logprobs": 21}, "prompt_logprobs"),
    ({"min_tokens": 2, "min_length": 3}, "min_length"),
    ({"guided_decoding_guide_type": "yaml"}, "guided_decoding_guide_type"),
    ({"guided_decoding_guide_type": "json_schema", "guided_decoding_guide": "{not json"}, "guided_decoding_guide"),
    ({"guided_decoding_guide_type": "regex", "guided_decoding_guide": "(unclosed"}, "guided_decoding_guide"),
    ({"guided_decoding_guide": "[a-z]+"}, "guided_decoding_guide"),
    ({"stop_token_ids": [10**7]}, "stop_token_ids"),
])
def test_bad_values_are_refused_naming_the_field(server, params, field):
    with pytest.raises(InferenceServerException, match=field):
        stream_generate(server.grpc_url, "hi", 8, **params)
    assert len(stream_generate(server.grpc_url, "Hello", 3, speculative_method="ngram").output_ids) == 3


def test_http_takes_the_controls_and_refuses_unknown_keys(server):
    base = f"http://{server.http_url}/v2/models/generate"
    body = {"text_input": JSON_PROMPT, "max_tokens": 96, "exclude_input_in_output": True, "speculative_method": "draft",
            "guided_decoding_guide_type": "json_schema", "guided_decoding_guide": json.dumps(SCHEMA),
            "bad_words": ["Bob"], "repetition_penalty": 1.1, "top_logprobs": 2}
    r = requests.post(f"{base}/generate", json=body, timeout=300)
    assert r.status_code == 200, r.text
    out = r.json()
    assert json.loads(out["text_output"])["age"] >= 0 and "Bob" not in out["text_output"]
    assert len(out["top_log_probs"]) == 2 * len(out["output_ids"])  # HTTP JSON flattens [n, 2] row by row
    r = requests.post(f"{base}/generate", json={"text_input": "hi", "max_tokens": 4, "repetition_penalt": 1.2},
                      timeout=60)
    assert r.status_code == 400 and "repetition_penalt" in r.text and "repetition_penalty" in r.text
    r = requests.post(f"{base}/generate", json={"text_input": "hi", "max_tokens": 4}, timeout=60)
    assert r.status_code == 200
