"""generate_trtllm against a real tritonserver (fixture ``server``), sent exactly the requests of NVIDIA's OpenAI
frontend.

The frontend (triton-inference-server/server, python/openai/openai_frontend/engine/utils/triton.py,
``_create_trtllm_generate_request``) cannot run here (it needs the in-process ``tritonserver`` Python API), so these
tests replay its requests with tritonclient: every input [1, 1] (``stop_words`` [1, n]), optional inputs only when the
OpenAI request sets them, ``return_num_input_tokens`` / ``return_num_output_tokens`` always; and they check what it
reads back: one or two responses for a non-streamed request, the last final, ``text_output`` of volume 1, each streamed
response's text a delta, usage from ``num_input_tokens`` (once) and ``num_output_tokens`` (summed over a stream).
"""

import json
import queue

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

from client.generate import stream_generate

N = 20  # tokens per request: the point is the format, not the length
N_SAMPLED = 12  # sampled requests run the verifier's kernels (interpreted on CPU here): slower per token
PROMPT = "def fibonacci(n):"
MODEL = "generate_trtllm"


def _tensor(name, arr):
    arr = np.asarray(arr)
    dtype = {"O": "BYTES", "b": "BOOL", "i": "INT32", "u": "UINT64", "f": "FP32"}[arr.dtype.kind]
    t = grpcclient.InferInput(name, list(arr.shape), dtype)
    t.set_data_from_numpy(arr)
    return t


def frontend_inputs(prompt, stream, max_tokens, stop=None, top_p=None, frequency_penalty=None, presence_penalty=None,
                    seed=None, temperature=None, echo=None, guided_json=None):
    """The inputs ``_create_trtllm_generate_request`` builds for an OpenAI request with these fields (None: not set)."""
    inputs = [_tensor("text_input", np.array([[prompt.encode()]], object)),
              _tensor("stream", np.array([[stream]], np.bool_)),
              _tensor("max_tokens", np.array([[max_tokens]], np.int32))]
    if stop:
        inputs.append(_tensor("stop_words", np.array([[w.encode() for w in stop]], object)))
    for name, value in (("top_p", top_p), ("frequency_penalty", frequency_penalty),
                        ("presence_penalty", presence_penalty)):
        if value is not None:
            inputs.append(_tensor(name, np.array([[value]], np.float32)))
    if seed is not None:
        inputs.append(_tensor("seed", np.array([[seed]], np.uint64)))
    if temperature is not None:
        inputs.append(_tensor("temperature", np.array([[temperature]], np.float32)))
    if echo is not None:  # only /v1/completions has echo
        inputs.append(_tensor("exclude_input_in_output", np.array([[not echo]], np.bool_)))
    if guided_json is not None:  # a chat request whose tool_choice names a tool
        inputs += [_tensor("guided_decoding_guide_type", np.array([[b"json_schema"]], object)),
                   _tensor("guided_decoding_guide", np.array([[guided_json.encode()]], object))]
    inputs += [_tensor("return_num_input_tokens", np.array([[True]], np.bool_)),
               _tensor("return_num_output_tokens", np.array([[True]], np.bool_))]
    return inputs


def send(server, inputs, timeout_s=120.0):
    """Every response to one request, as (outputs by name, final flag), through a gRPC stream.

    Raises:
        InferenceServerException: an error response.
    """
    q: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(server.grpc_url)
    client.start_stream(callback=lambda result, error: q.put((result, error)))
    try:
        client.async_stream_infer(MODEL, inputs, enable_empty_final_response=True)
        out = []
        while True:
            result, error = q.get(timeout=timeout_s)
            if error is not None:
                raise error
            resp = result.get_response()
            out.append(({o.name: result.as_numpy(o.name) for o in resp.outputs},
                        resp.parameters["triton_final_response"].bool_param))
            if out[-1][1]:
                return out
    finally:
        client.stop_stream()
        client.close()


def text_of(outputs) -> str:
    """The frontend's ``_to_string``: exactly one string."""
    t = outputs["text_output"]
    assert t.size == 1 and t.shape == (1, 1), t.shape
    return t[0, 0].decode()


def usage(responses) -> tuple[int, int]:
    """(prompt_tokens, completion_tokens) as the frontend's streaming accumulator counts them (non-streamed: the
    first response's)."""
    counted = [o for o, _ in responses if "num_input_tokens" in o and "num_output_tokens" in o]
    assert all(o["num_input_tokens"].dtype == np.uint32 and o["num_input_tokens"].shape == (1, 1) for o in counted)
    return int(counted[0]["num_input_tokens"][0, 0]), sum(int(o["num_output_tokens"][0, 0]) for o in counted)


@pytest.fixture(scope="module")
def reference(server, real_tokenizer):
    """generate's greedy output for PROMPT sent the normal way (shape [1], streamed), and the prompt's token count."""
    r = stream_generate(server.grpc_url, PROMPT, N)
    return r, len(real_tokenizer(PROMPT)["input_ids"])


def test_a_non_streamed_completion_is_one_final_response_without_the_prompt(server, reference):
    ref, prompt_tokens = reference
    responses = send(server, frontend_inputs(PROMPT, False, N))
    assert 1 <= len(responses) <= 2 and responses[-1][1]  # _validate_triton_responses_non_streaming
    assert text_of(responses[0][0]) == ref.text and not ref.text.startswith(PROMPT)
    assert usage(responses[:1]) == (prompt_tokens, len(ref.output_ids))
    echoed = send(server, frontend_inputs(PROMPT, False, N, echo=True))  # /v1/completions with echo: true
    assert text_of(echoed[0][0]) == PROMPT + ref.text


def test_a_streamed_completion_sends_deltas_and_usage_that_sums(server, reference):
    ref, prompt_tokens = reference
    responses = send(server, frontend_inputs(PROMPT, True, N))
    assert len(responses) > 1 and responses[-1][1] and not any(final for _, final in responses[:-1])
    assert "".join(text_of(o) for o, _ in responses if "text_output" in o) == ref.text
    assert usage(responses) == (prompt_tokens, len(ref.output_ids))
    assert int(responses[-1][0]["num_emitted_tokens"][0, 0]) == len(ref.output_ids)


def test_stop_words_cut_the_text(server, reference):
    ref, _ = reference
    start = len(ref.text) // 3  # a 3-character stop string first found a third of the way in
    word = next(ref.text[a:a + 3] for a in range(start, len(ref.text) - 3) if ref.text.find(ref.text[a:a + 3]) == a)
    responses = send(server, frontend_inputs(PROMPT, False, N, stop=[word, "@@never@@"]))
    assert text_of(responses[0][0]) == ref.text[: ref.text.index(word)]
    assert responses[0][0]["finish_reason"][0, 0] == b"stop"


def test_seed_makes_a_sampled_request_reproducible(server):
    texts = [text_of(send(server, frontend_inputs(PROMPT, False, N_SAMPLED, seed=11, temperature=0.8))[0][0])
             for _ in range(2)]
    assert texts[0] == texts[1] and texts[0]


def test_seed_top_p_temperature_and_penalties_reach_generate(server):
    """The same sampling controls sent the normal way, with the seed as random_seed, give the same text: each reached
    generate (a seed dropped on the way would leave two independent draws)."""
    controls = dict(top_p=0.9, temperature=0.7, presence_penalty=0.5, frequency_penalty=0.3)
    text = text_of(send(server, frontend_inputs(PROMPT, False, N_SAMPLED, seed=5, **controls))[0][0])
    assert text == stream_generate(server.grpc_url, PROMPT, N_SAMPLED, random_seed=5, **controls).text


def test_a_named_tool_choice_gives_json_that_follows_its_schema(server, real_tokenizer):
    """A chat request (chat template, no echo input) with tool_choice naming a tool: the guide is its parameters'
    JSON schema."""
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 6}}, "required": ["name"],
              "additionalProperties": False}
    prompt = real_tokenizer.apply_chat_template([{"role": "user", "content": "Name a person, as JSON."}],
                                                tokenize=False, add_generation_prompt=True)
    responses = send(server, frontend_inputs(prompt, False, 24, guided_json=json.dumps(schema)))
    value = json.loads(text_of(responses[0][0]))
    assert set(value) == {"name"} and isinstance(value["name"], str) and len(value["name"]) <= 6


def test_a_bad_value_is_an_error_naming_the_field(server):
    with pytest.raises(InferenceServerException, match="'temperature'"):
        send(server, frontend_inputs(PROMPT, False, N, temperature=-1.0))
    with pytest.raises(InferenceServerException, match="'seed'"):  # both seeds, different: generate names seed
        send(server, frontend_inputs(PROMPT, False, N, seed=1) + [_tensor("random_seed", np.array([[2]], np.uint64))])


def test_a_cancelled_stream_ends_and_the_model_serves_on(server, reference):
    """The client cancels after the first delta (as the frontend cancels an abandoned request): the stream ends, and the
    next request is served (Triton 2.51 cannot cancel the inner BLS request: generate finishes it meanwhile)."""
    q: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(server.grpc_url)
    client.start_stream(callback=lambda result, error: q.put((result, error)))
    try:
        client.async_stream_infer(MODEL, frontend_inputs(PROMPT, True, N), enable_empty_final_response=True)
        result, error = q.get(timeout=120)
        assert error is None and text_of({"text_output": result.as_numpy("text_output")})
    finally:
        client.stop_stream(cancel_requests=True)
        client.close()
    ref, _ = reference
    assert text_of(send(server, frontend_inputs(PROMPT, False, N))[0][0]) == ref.text
