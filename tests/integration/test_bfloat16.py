"""bfloat16 through the real server (spec_decode.engine.invariant_attention, dtype_choice): the embedded target, its
self-draft, suffix decoding and n-gram lookup (drafting trees, the server's default) served in bfloat16 on this CPU
give plain decoding's greedy tokens with every method, one stream at a time and all streams at once, and a seeded
sampled request the same tokens with every method; the load log says which dtype and that the forward is
batch-invariant."""

from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from client.datasets import humaneval_prompts
from client.generate import stream_generate
from spec_decode.engine.dtype_choice import kernels_batch_invariant

METHODS = ("none", "suffix", "ngram", "draft")  # plain, the default, n-gram (whose trees branch) and the self-draft
N_PROMPTS, N_TOKENS = 2, 32

pytestmark = pytest.mark.skipif(not kernels_batch_invariant(torch.bfloat16),
                                reason="this CPU's bfloat16 kernels are not batch-invariant: dtype auto serves float32 "
                                       "here, and bfloat16 asked for is served with a warning")


@pytest.fixture(scope="module")
def bf16_server(running_server, tmp_path_factory):
    from spec_decode.launcher import draft_overrides, prepare_repository

    overrides = draft_overrides("default")  # the target drafts for itself: every draft accepted, long steps
    overrides["draft_model"].update(dtype="bfloat16", draft_min_token_prob="0")
    overrides["target_model"] = {"dtype": "bfloat16"}
    log = tmp_path_factory.mktemp("triton-bf16") / "server.log"
    yield from running_server(prepare_repository(overrides), log)


def _ids(url: str, prompt: str, method: str, **kw) -> list[int]:
    return list(stream_generate(url, prompt, N_TOKENS, speculative_method=method, num_draft_tokens=4, **kw).output_ids)


def test_every_method_gives_plain_decodings_greedy_tokens_alone_and_concurrently(bf16_server):
    log = bf16_server.log_tail(100000)
    assert "in bfloat16 (asked for)" in log and "batch-invariant forward: yes" in log, log[-3000:]
    url, prompts = bf16_server.grpc_url, humaneval_prompts(N_PROMPTS)
    plain = [_ids(url, p, "none") for p in prompts]
    assert all(len(ids) > 10 for ids in plain)
    for method in METHODS[1:]:
        assert [_ids(url, p, method) for p in prompts] == plain, method
    jobs = [(m, i) for m in METHODS for i in range(N_PROMPTS)]  # 8 streams at once
    with ThreadPoolExecutor(len(jobs)) as pool:
        got = list(pool.map(lambda job: _ids(url, prompts[job[1]], job[0]), jobs))
    for (method, i), ids in zip(jobs, got):
        assert ids == plain[i], (method, i)


def test_a_seeded_sampled_request_gives_the_same_tokens_with_every_method(bf16_server):
    prompt = humaneval_prompts(3)[2]
    sampled = {m: _ids(bf16_server.grpc_url, prompt, m, temperature=0.8, top_p=0.95, random_seed=11) for m in METHODS}
    assert len(sampled["none"]) > 10
    assert all(ids == sampled["none"] for ids in sampled.values()), sampled
