"""Draft trees through the real server (spec_decode.tree; docs/trees.md): the model-free proposers draft trees by
default, every method's greedy output with trees on and off is the target's own greedy output at 1 and 8 concurrent
streams, a seeded sampled request gives the same tokens with trees, chains and plain decoding, and the metrics count
tree steps and acceptance per depth."""

from concurrent.futures import ThreadPoolExecutor

import pytest

from client.generate import stream_generate
from client.metrics import scrape, value, wait_for

N_TOKENS = 32  # a prefix of the 64 tokens greedy_references (conftest.py) holds per prompt
# the proposers that draft trees (hybrid: suffix's, or n-gram's merged; the heads: their top-k combined)
HEAD_TREE_METHODS = ("eagle", "eagle3", "medusa", "mlp_speculator", "arctic")
TREE_METHODS = ("suffix", "ngram", "hybrid", *HEAD_TREE_METHODS)


def _ids(url: str, prompt: str, method: str, tree: bool, **kw) -> list[int]:
    return list(stream_generate(url, prompt, N_TOKENS, speculative_method=method, num_draft_tokens=8, draft_tree=tree,
                                **kw).output_ids)




def branchy(name: str) -> str:
    """A prompt whose text repeats a context with several continuations, so every proposer that drafts trees
    branches on it; ``name`` makes it new to the server's suffix cache (a response cached earlier would make
    suffix decoding's best match a chain)."""
    return (f"{name} = {{}}\n{name}['red'] = 1\n{name}['green'] = 2\n{name}['blue'] = 3\n{name}['red'] = 4\n"
            f"{name}['green'] = 5\n{name}['blue'] = 6\n{name}['")


@pytest.mark.parametrize("method", ("suffix", "ngram"))
def test_greedy_with_trees_and_chains_equals_target_greedy_alone_and_concurrently(server, greedy_references, method):
    """Trees on and off, alone on a prompt that branches (first, while the prompt is new to the server: the method's
    tree-step counter rose) and 8 streams at once (4 HumanEval prompts, trees on and off): each output is the
    target's greedy output. hybrid's trees: the seeded test below and tests/integration/test_server.py."""
    before = scrape(server.metrics_url)
    url = server.grpc_url
    prompt = branchy(f"colors_{method}")
    drafted_as_tree = _ids(url, prompt, method, True)
    assert drafted_as_tree == _ids(url, prompt, "none", False) == _ids(url, prompt, method, False)
    jobs = [(p, ref, tree) for tree in (True, False) for p, ref in greedy_references[:4]]  # 8 streams at once
    with ThreadPoolExecutor(len(jobs)) as pool:
        got = list(pool.map(lambda job: _ids(url, job[0], method, job[2]), jobs))
    for (prompt, ref, tree), ids in zip(jobs, got):
        assert ids == ref[:N_TOKENS], (method, tree, prompt[:50])
    steps = value(before, "spec_decode_tree_steps_total", method=method)
    # generate exports its metrics at most every 0.5 s and when a request ends: wait for the last request's
    after = wait_for(server.metrics_url, lambda s: value(s, "spec_decode_tree_steps_total", method=method) > steps,
                     timeout_s=10)
    drafted = [value(after, "spec_decode_drafted_depth_total", method=method, depth=str(d)) for d in (1, 2)]
    accepted = value(after, "spec_decode_accepted_depth_total", method=method, depth="1")
    assert drafted[0] >= drafted[1] > 0 and 0 < accepted <= drafted[0]


@pytest.mark.parametrize("method", HEAD_TREE_METHODS)
def test_head_candidate_trees_equal_target_greedy_alone_and_concurrently(server, greedy_references, method):
    """A head (random weights, drafting every node: speculator_min_token_prob 0; the EAGLE-3 head trained at a tiny
    size) drafts candidate trees of its heads' top-k (Medusa: medusa_choices dynamic; EAGLE's heads, the MLP and
    Arctic speculators: EAGLE-2's expansion and rerank); greedy output with trees is the target's own, 3 streams at
    once, and the tree steps are counted."""
    before = scrape(server.metrics_url)
    jobs = greedy_references[:3]
    with ThreadPoolExecutor(len(jobs)) as pool:
        got = list(pool.map(lambda job: _ids(server.grpc_url, job[0], method, True), jobs))
    for (prompt, ref), ids in zip(jobs, got):
        assert ids == ref[:N_TOKENS], prompt[:50]
    steps = value(before, "spec_decode_tree_steps_total", method=method)
    wait_for(server.metrics_url, lambda s: value(s, "spec_decode_tree_steps_total", method=method) > steps,
             timeout_s=10)


def test_a_request_s_tree_top_k_and_tree_depth_keep_greedy_output_the_target_s(server, greedy_references):
    """Per-request tree shapes (tree_top_k, tree_depth: the config's tree_top_k / tree_depth for that request alone)
    with EAGLE-3 and the draft LM (the target drafting for itself): greedy output is the target's; a width out of
    range is refused, naming it and the range, and the server goes on serving."""
    from tritonclient.utils import InferenceServerException

    prompt, ref = greedy_references[0]
    cases = [(method, shape) for method in ("eagle3", "draft")
             for shape in ({"tree_top_k": 1}, {"tree_top_k": 8, "tree_depth": 2}, {"tree_top_k": 3})]
    cases.append(("eagle3", {"tree_depth": 1}))
    with ThreadPoolExecutor(4) as pool:  # four at a time: a round batches them
        got = list(pool.map(lambda case: _ids(server.grpc_url, prompt, case[0], True, **case[1]), cases))
    for case, ids in zip(cases, got):
        assert ids == ref[:N_TOKENS], case
    with pytest.raises(InferenceServerException, match=r"tree_top_k.*\[0, 10\]"):
        _ids(server.grpc_url, prompt, "eagle3", True, tree_top_k=11)


def test_a_seeded_sampled_request_gives_the_same_tokens_with_trees_chains_and_none(server, greedy_references):
    prompt = greedy_references[3][0]
    kw = dict(temperature=0.8, top_p=0.95, random_seed=7)
    plain = _ids(server.grpc_url, prompt, "none", False, **kw)
    assert len(plain) > 10
    # the proposers that draft a sampled request trees (the other heads draft it their chains: every method at k 4,
    # the model proposers at 1 too, tests/integration/test_server.py), four at a time: the coupled race keys the
    # noise by seed and position
    cases = [(method, tree) for method in ("suffix", "ngram", "hybrid") for tree in (True, False)] + [("medusa", True)]
    with ThreadPoolExecutor(4) as pool:
        got = list(pool.map(lambda case: _ids(server.grpc_url, prompt, *case, **kw), cases))
    for case, ids in zip(cases, got):
        assert ids == plain, case


def test_a_guided_request_drafts_chains_and_says_so(server):
    """A grammar walks one path: a guided request that allows trees drafts chains, counted by reason."""
    before = scrape(server.metrics_url)
    r = stream_generate(server.grpc_url, "The answer is", 16, speculative_method="suffix", num_draft_tokens=4,
                        draft_tree=True, guided_decoding_guide_type="regex", guided_decoding_guide="[0-9]{3} apples")
    assert r.text.startswith(tuple("0123456789"))
    key = dict(method="suffix", reason="guided")
    fallback = value(before, "spec_decode_chain_fallback_steps_total", **key)
    wait_for(server.metrics_url, lambda s: value(s, "spec_decode_chain_fallback_steps_total", **key) > fallback,
             timeout_s=10)


def test_draft_tree_over_the_http_generate_extension(server, greedy_references):
    """The HTTP generate extension takes draft_tree as a JSON boolean (Triton itself refuses other JSON types)."""
    import requests

    prompt, ref = greedy_references[1]
    base = f"http://{server.http_url}/v2/models/generate/generate"
    body = {"text_input": prompt, "max_tokens": 16, "exclude_input_in_output": True, "speculative_method": "suffix"}
    for tree in (True, False):
        r = requests.post(base, json={**body, "draft_tree": tree}, timeout=300)
        assert r.status_code == 200 and r.json()["output_ids"] == ref[:16], r.text
