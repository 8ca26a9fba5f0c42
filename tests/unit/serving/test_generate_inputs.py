"""spec_decode.serving.generate_inputs (and spec_decode.request): request validation; every bad field gets an error
naming it."""

import numpy as np
import pytest

from spec_decode.request import GenerationRequest
from spec_decode.serving.generate_inputs import RequestLimits, parse_request
from spec_decode.settings import GenerateSettings, InvalidInputError

LIMITS = RequestLimits(GenerateSettings(), ("none", "ngram", "suffix", "hybrid"), vocab_size=100)


def _req(**kw):
    base = {"text_input": np.array([b"hi"], object), "max_tokens": np.array([8], np.int32)}
    base.update(kw)
    return base


def test_defaults():
    r = parse_request(_req(), LIMITS)
    assert (r.text_input, r.max_tokens, r.speculative_method, r.temperature) == ("hi", 8, "suffix", 0.0)
    assert r.stream is False  # as the TensorRT-LLM and vLLM backends


@pytest.mark.parametrize(
    "inputs, field",
    [
        ({"text_input": np.array([b""], object)}, "text_input"),
        ({"text_input": np.array([b"\xff\xfe"], object)}, "text_input"),
        ({"max_tokens": np.array([0], np.int32)}, "max_tokens"),
        ({"max_tokens": np.array([10**6], np.int32)}, "max_tokens"),
        ({"max_tokens": np.array([1.5], np.float32)}, "max_tokens"),
        ({"temperature": np.array([-1.0], np.float32)}, "temperature"),
        ({"top_p": np.array([0.0], np.float32)}, "top_p"),
        ({"top_k": np.array([-2], np.int32)}, "top_k"),
        ({"speculative_method": np.array([b"magic"], object)}, "speculative_method"),
        ({"speculative_method": np.array([b"draft"], object)}, "speculative_method"),  # no draft model here
        ({"num_draft_tokens": np.array([99], np.int32)}, "num_draft_tokens"),
        ({"stop_words": np.array([b""], object)}, "stop_words"),
        ({"stop_words": np.array([b"ok", b"\xc3"], object)}, "stop_words"),
        ({"temperature": np.array([float("nan")], np.float32)}, "temperature"),
        ({"temperature": np.array([1], np.int32)}, "temperature"),
        ({"random_seed": np.array([-1], np.int64)}, "random_seed"),
        ({"end_id": np.array([100], np.int32)}, "end_id"),
        ({"acceptance_method": np.array([b"maybe"], object)}, "acceptance_method"),
        ({"tree_top_k": np.array([11], np.int32)}, "tree_top_k"),
        ({"tree_depth": np.array([-1], np.int32)}, "tree_depth"),
    ],
)
def test_bad_fields_are_named(inputs, field):
    with pytest.raises(InvalidInputError, match=f"'{field}'") as e:
        parse_request(_req(**inputs), LIMITS)
    assert e.value.field == field


def test_stop_word_error_names_the_element():
    with pytest.raises(InvalidInputError, match="element 1"):
        parse_request(_req(stop_words=np.array([b"ok", b"\xc3"], object)), LIMITS)


def test_missing_required():
    with pytest.raises(InvalidInputError, match="'max_tokens'"):
        parse_request({"text_input": np.array([b"x"], object)}, LIMITS)


def test_sizes_that_would_stall_the_event_loop_are_refused():
    """A prompt that cannot fit in max_model_len tokens is refused before tokenisation; stop words are bounded."""
    with pytest.raises(InvalidInputError, match="text_input.*at most") as e:
        parse_request(_req(text_input=np.array([b"w " * (LIMITS.settings.max_model_len * 17)], object)), LIMITS)
    assert e.value.field == "text_input"
    with pytest.raises(InvalidInputError, match="at most 64 stop words"):
        parse_request(_req(stop_words=np.array([b"x%d" % i for i in range(65)], object)), LIMITS)
    with pytest.raises(InvalidInputError, match="at most 1024 characters"):
        parse_request(_req(stop_words=np.array([b"y" * 1025], object)), LIMITS)
    assert len(parse_request(_req(stop_words=np.array([b"z%d" % i for i in range(64)], object)),
                             LIMITS).stop_words) == 64


def test_the_server_defaults_come_from_generate_s_settings_and_requests_are_frozen():
    limits = RequestLimits(GenerateSettings(default_speculative_method="ngram", num_draft_tokens=2), LIMITS.methods)
    r = parse_request(_req(), limits)
    assert (r.speculative_method, r.num_draft_tokens, r.acceptance_method) == ("ngram", 2, "")
    r = parse_request(_req(speculative_method=np.array([b" Suffix "], object),
                           acceptance_method=np.array([b"TYPICAL"], object)), limits)
    assert (r.speculative_method, r.acceptance_method) == ("suffix", "typical")
    with pytest.raises(AttributeError):
        r.max_tokens = 3  # noqa: B018 - frozen: what was checked cannot change afterwards
    with pytest.raises(InvalidInputError, match="'top_k'"):
        GenerationRequest("x", 4, top_k=-1)  # built directly, the same rules apply


def test_the_processor_controls_are_parsed_under_the_tensorrt_llm_names():
    r = parse_request(_req(repetition_penalty=np.array([1.2], np.float32), presence_penalty=np.array([0.5], np.float32),
                           frequency_penalty=np.array([-0.5], np.float32), min_length=np.array([3], np.int32),
                           bad_words=np.array([b"foo", b"bar baz"], object),
                           stop_token_ids=np.array([7, 9], np.int32), top_logprobs=np.array([4], np.int32),
                           prompt_logprobs=np.array([0], np.int32),
                           guided_decoding_guide_type=np.array([b"regex"], object),
                           guided_decoding_guide=np.array([b"[a-z]+"], object), n=np.array([1], np.int32)), LIMITS)
    assert (r.repetition_penalty, r.presence_penalty, r.frequency_penalty) == pytest.approx((1.2, 0.5, -0.5))
    assert (r.min_tokens, r.bad_words, r.stop_token_ids) == (3, ("foo", "bar baz"), (7, 9))
    assert (r.top_logprobs, r.prompt_logprobs, r.guided_decoding_guide_type) == (4, 0, "regex")
    assert r.wants_logprobs and not parse_request(_req(), LIMITS).wants_logprobs


@pytest.mark.parametrize("inputs, field", [
    ({"n": np.array([2], np.int32)}, "n"), ({"beam_width": np.array([4], np.int32)}, "beam_width"),
    ({"num_return_sequences": np.array([2], np.int32)}, "num_return_sequences"),
    ({"repetition_penalty": np.array([0.0], np.float32)}, "repetition_penalty"),
    ({"presence_penalty": np.array([2.5], np.float32)}, "presence_penalty"),
    ({"frequency_penalty": np.array([np.nan], np.float32)}, "frequency_penalty"),
    ({"min_tokens": np.array([9], np.int32)}, "min_tokens"),  # above max_tokens = 8
    ({"min_tokens": np.array([-1], np.int32)}, "min_tokens"),
    ({"min_tokens": np.array([2], np.int32), "min_length": np.array([3], np.int32)}, "min_length"),
    ({"top_logprobs": np.array([21], np.int32)}, "top_logprobs"),
    ({"prompt_logprobs": np.array([-1], np.int32)}, "prompt_logprobs"),
    ({"stop_token_ids": np.array([100], np.int32)}, "stop_token_ids"),  # vocabulary of 100
    ({"stop_token_ids": np.array([1.5], np.float32)}, "stop_token_ids"),
    ({"bad_words": np.array([b""], object)}, "bad_words"),
    ({"guided_decoding_guide_type": np.array([b"xml"], object)}, "guided_decoding_guide_type"),
    ({"guided_decoding_guide": np.array([b"[a-z]"], object)}, "guided_decoding_guide"),
    ({"guided_decoding_guide_type": np.array([b"json_schema"], object),
      "guided_decoding_guide": np.array([b'{"type": '], object)}, "guided_decoding_guide"),
    ({"guided_decoding_guide_type": np.array([b"regex"], object), "guided_decoding_guide": np.array([b"(a"], object)},
     "guided_decoding_guide"),
    ({"guided_decoding_guide_type": np.array([b"json"], object), "ignore_eos": np.array([True])}, "ignore_eos"),
])
def test_bad_processor_controls_are_named(inputs, field):
    with pytest.raises(InvalidInputError, match=f"'{field}'"):
        parse_request(_req(**inputs), LIMITS)


def test_request_parameters_are_refused_naming_the_key_and_listing_the_inputs():
    from spec_decode.serving.generate_inputs import check_parameters

    check_parameters({})
    with pytest.raises(InvalidInputError, match=r"'repetition_penalt'.*accepted: .*repetition_penalty"):
        check_parameters({"repetition_penalt": 1.2})


def test_seed_is_random_seed_s_other_name_and_a_conflict_names_it():
    """NVIDIA's OpenAI frontend sends ``seed`` (UINT64): the same as random_seed; both with different values are
    refused naming ``seed``, equal ones are one seed."""
    assert parse_request(_req(seed=np.array([7], np.uint64)), LIMITS).random_seed == 7
    both = _req(seed=np.array([7], np.uint64), random_seed=np.array([7], np.uint64))
    assert parse_request(both, LIMITS).random_seed == 7
    big = parse_request(_req(seed=np.array([(1 << 64) - 1], np.uint64)), LIMITS).random_seed
    assert big == parse_request(_req(random_seed=np.array([(1 << 64) - 1], np.uint64)), LIMITS).random_seed
    with pytest.raises(InvalidInputError, match=r"'seed': is random_seed's other name.*random_seed=7, seed=8") as e:
        parse_request(_req(seed=np.array([8], np.uint64), random_seed=np.array([7], np.uint64)), LIMITS)
    assert e.value.field == "seed"
    for bad in (np.array([-1], np.int64), np.array([1.5], np.float32), np.array([1, 2], np.uint64)):
        with pytest.raises(InvalidInputError, match="'seed'"):
            parse_request(_req(seed=bad), LIMITS)


def test_the_usage_flags_are_parsed_and_off_by_default():
    r = parse_request(_req(), LIMITS)
    assert (r.return_num_input_tokens, r.return_num_output_tokens) == (False, False)
    r = parse_request(_req(return_num_input_tokens=np.array([True]), return_num_output_tokens=np.array([True])),
                      LIMITS)
    assert (r.return_num_input_tokens, r.return_num_output_tokens) == (True, True)
    with pytest.raises(InvalidInputError, match="'return_num_output_tokens': expected BOOL"):
        parse_request(_req(return_num_output_tokens=np.array([b"yes"], object)), LIMITS)
