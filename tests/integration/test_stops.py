"""Stop words under ``min_tokens`` against the real server (fixture ``server``; issue 41, vLLM #21987): the target's
greedy answer repeats the stop word, and every method at every k, streamed and not, through generate (gRPC and HTTP)
and generate_trtllm, gives the plain decoder's cut: the first occurrence completed at or after the min_tokens-th token
ends the request, the text cut before it, the ids through the token that completed it. (The OpenAI endpoints:
tests/integration/test_openai.py.)"""

import json

import numpy as np
import pytest
import requests
import torch

from client.generate import stream_generate
from spec_decode.proposers import METHODS
from tests.helpers import plain_stop_cut
from tests.integration.test_trtllm_format import _tensor, frontend_inputs, send, text_of

PROMPT = "List: fig, fig, fig, fig,"  # the target answers " fig, fig, fig, ..."
STOP = ["fig"]
MAX_TOKENS = 16
MIN_TOKENS = (4, 6, 9)


@pytest.fixture(scope="module")
def fig_cuts(real_model, real_tokenizer):
    """min_tokens -> (ids, text) of the plain decoder's cut of the target's greedy answer (transformers, in process),
    after checking the answer exercises the bug: an occurrence of the stop word completes before min_tokens."""
    prompt = real_tokenizer(PROMPT)["input_ids"]
    with torch.inference_mode():
        ids = real_model.generate(torch.tensor([prompt]), max_new_tokens=MAX_TOKENS, do_sample=False)[0, len(prompt):]
    ids = ids.tolist()
    first = plain_stop_cut(real_tokenizer, prompt, ids, STOP, 0)
    cuts = {}
    for mt in MIN_TOKENS:
        cut = plain_stop_cut(real_tokenizer, prompt, ids, STOP, mt)
        assert first is not None and first[0] < mt and cut is not None, (real_tokenizer.decode(ids), mt)
        cuts[mt] = (ids[: cut[0]], cut[1])
    assert len({c[1] for c in cuts.values()}) == len(MIN_TOKENS)  # each min_tokens cuts elsewhere
    return cuts


@pytest.mark.parametrize("method", (*METHODS, "auto"))
def test_every_method_and_k_cut_where_plain_decoding_does(server, fig_cuts, method):
    for k in (1, 4, 8) if method != "none" else (0,):
        for mt, (ids, text) in fig_cuts.items():
            r = stream_generate(server.grpc_url, PROMPT, MAX_TOKENS, speculative_method=method, num_draft_tokens=k,
                                stop_words=STOP, min_tokens=mt, return_log_probs=True)
            assert (r.text, r.output_ids, r.stats["finish_reason"]) == (text, ids, "stop"), (method, k, mt)
            assert len(r.stats["output_log_probs"]) == len(ids) and r.stats["num_emitted_tokens"] == len(ids)
            assert not r.text.endswith("fig")


@pytest.mark.parametrize("method", ["none", "suffix"])
def test_streamed_and_not_through_grpc_http_and_generate_trtllm(server, fig_cuts, method):
    base = f"http://{server.http_url}/v2/models/generate"
    for mt, (ids, text) in fig_cuts.items():
        kw = dict(speculative_method=method, num_draft_tokens=8, stop_words=STOP, min_tokens=mt)
        one = stream_generate(server.grpc_url, PROMPT, MAX_TOKENS, stream=False, exclude_input_in_output=True, **kw)
        assert (one.text, one.output_ids, one.stats["finish_reason"]) == (text, ids, "stop"), (method, mt)
        assert len(one.responses) == 1

        body = {"text_input": PROMPT, "max_tokens": MAX_TOKENS, "exclude_input_in_output": True, **kw}
        r = requests.post(f"{base}/generate", json=body, timeout=300)
        assert r.status_code == 200, r.text
        assert (r.json()["text_output"], r.json()["finish_reason"]) == (text, "stop")
        r = requests.post(f"{base}/generate_stream", json={**body, "stream": True}, stream=True, timeout=300)
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith(b"data: ")]
        assert "".join(e["text_output"] for e in events) == text and events[-1]["finish_reason"] == "stop"

        for stream in (False, True):
            extra = [_tensor("min_tokens", np.array([[mt]], np.int32)),
                     _tensor("speculative_method", np.array([[method.encode()]], object)),
                     _tensor("num_draft_tokens", np.array([[8]], np.int32))]
            responses = send(server, frontend_inputs(PROMPT, stream, MAX_TOKENS, stop=STOP) + extra)
            got = "".join(text_of(o) for o, _ in responses if "text_output" in o)
            out_ids = [int(i) for o, _ in responses if "output_ids" in o for i in o["output_ids"].reshape(-1)]
            assert (got, out_ids) == (text, ids), (method, mt, stream)
            assert [o["finish_reason"][0, 0] for o, _ in responses if "finish_reason" in o] == [b"stop"]
