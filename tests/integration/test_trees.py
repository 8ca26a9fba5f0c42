"""Draft trees through the real server (spec_decode.tree; docs/trees.md): the model-free proposers draft trees by
default, every method's greedy output with trees on and off is the target's own greedy output at 1 and 8 concurrent
streams, a seeded sampled request gives the same tokens with trees, chains and plain decoding, and the metrics count
tree steps and acceptance per depth."""

from concurrent.futures import ThreadPoolExecutor

import pytest

from client.generate import stream_generate
from client.metrics import scrape, value

N_TOKENS = 32  # a prefix of the 64 tokens greedy_references (conftest.py) holds per prompt
TREE_METHODS = ("suffix", "ngram", "hybrid")  # the proposers that draft trees


def _ids(url: str, prompt: str, method: str, tree: bool, **kw) -> list[int]:
    return list(stream_generate(url, prompt, N_TOKENS, speculative_method=method, num_draft_tokens=8, draft_tree=tree,
                                **kw).output_ids)


# a prompt whose text repeats a context with several continuations: every proposer that drafts trees branches here
BRANCHY = ("colors = {}\ncolors['red'] = 1\ncolors['green'] = 2\ncolors['blue'] = 3\ncolors['red'] = 4\n"
           "colors['green'] = 5\ncolors['blue'] = 6\ncolors['")


@pytest.mark.parametrize("method", TREE_METHODS)
def test_greedy_with_trees_and_chains_equals_target_greedy_alone_and_concurrently(server, greedy_references, method):
    """Trees on and off, alone on a prompt that branches (the method's tree-step counter rose) and 8 streams at once
    (4 HumanEval prompts, trees on and off): each output is the target's greedy output."""
    before = scrape(server.metrics_url)
    url = server.grpc_url
    plain = _ids(url, BRANCHY, "none", False)
    assert _ids(url, BRANCHY, method, True) == plain == _ids(url, BRANCHY, method, False)
    jobs = [(p, ref, tree) for tree in (True, False) for p, ref in greedy_references[:4]]  # 8 streams at once
    with ThreadPoolExecutor(len(jobs)) as pool:
        got = list(pool.map(lambda job: _ids(url, job[0], method, job[2]), jobs))
    for (prompt, ref, tree), ids in zip(jobs, got):
        assert ids == ref[:N_TOKENS], (method, tree, prompt[:50])
    after = scrape(server.metrics_url)
    steps = [value(s, "spec_decode_tree_steps_total", method=method) for s in (before, after)]
    assert steps[1] > steps[0], f"{method} drafted no tree"
    drafted = [value(after, "spec_decode_drafted_depth_total", method=method, depth=str(d)) for d in (1, 2)]
    accepted = value(after, "spec_decode_accepted_depth_total", method=method, depth="1")
    assert drafted[0] >= drafted[1] > 0 and 0 < accepted <= drafted[0]


def test_a_seeded_sampled_request_gives_the_same_tokens_with_trees_chains_and_none(server, greedy_references):
    prompt = greedy_references[3][0]
    kw = dict(temperature=0.8, top_p=0.95, random_seed=7)
    plain = _ids(server.grpc_url, prompt, "none", False, **kw)
    assert len(plain) > 10
    for method in TREE_METHODS:
        for tree in (True, False):
            assert _ids(server.grpc_url, prompt, method, tree, **kw) == plain, (method, tree)


def test_a_guided_request_drafts_chains_and_says_so(server):
    """A grammar walks one path: a guided request that allows trees drafts chains, counted by reason."""
    before = scrape(server.metrics_url)
    r = stream_generate(server.grpc_url, "The answer is", 16, speculative_method="suffix", num_draft_tokens=4,
                        draft_tree=True, guided_decoding_guide_type="regex", guided_decoding_guide="[0-9]{3} apples")
    assert r.text.startswith(tuple("0123456789"))
    after = scrape(server.metrics_url)
    key = dict(method="suffix", reason="guided")
    assert value(after, "spec_decode_chain_fallback_steps_total", **key) > value(
        before, "spec_decode_chain_fallback_steps_total", **key)


def test_draft_tree_over_the_http_generate_extension(server, greedy_references):
    """The HTTP generate extension takes draft_tree as a JSON boolean (Triton itself refuses other JSON types)."""
    import requests

    prompt, ref = greedy_references[1]
    base = f"http://{server.http_url}/v2/models/generate/generate"
    body = {"text_input": prompt, "max_tokens": 16, "exclude_input_in_output": True, "speculative_method": "suffix"}
    for tree in (True, False):
        r = requests.post(base, json={**body, "draft_tree": tree}, timeout=300)
        assert r.status_code == 200 and r.json()["output_ids"] == ref[:16], r.text
