"""speculative_method=auto against a real tritonserver (fixture ``server``: every method served, the target drafting
for itself as ``draft``), through tritonclient as users do, on the real embedded model."""

import threading
import time

import requests

from client.generate import stream_generate
from client.metrics import scrape, value
from spec_decode.proposers import METHODS

N_TOKENS = 64  # greedy_references (conftest.py) holds this many tokens per prompt
SINGLES = set(METHODS) - {"hybrid"}  # what auto chooses among (none included)


def _auto_steps(metrics_url: str, name: str = "spec_decode_auto_steps_total") -> dict[str, float]:
    samples = scrape(metrics_url)
    if name == "spec_decode_auto_tree_steps_total":  # by method and tree width: summed over the widths
        return {m: sum(v for (n, labels), v in samples.items() if n == name and ("method", m) in labels)
                for m in SINGLES}
    return {m: value(samples, name, method=m) for m in SINGLES}


def test_auto_greedy_equals_target_greedy_and_reports_its_choice_per_step(server, greedy_references):
    """auto's greedy output is the target's; each step's method and k come back, and its metrics count every step,
    the tree steps among them (a request allows trees by default, and before any evidence auto tries a tree)."""
    before = _auto_steps(server.metrics_url)
    trees_before = sum(_auto_steps(server.metrics_url, "spec_decode_auto_tree_steps_total").values())
    steps = 0
    chosen: set[str] = set()
    for prompt, ref in greedy_references:
        r = stream_generate(server.grpc_url, prompt, N_TOKENS, speculative_method="auto", num_draft_tokens=4)
        assert r.output_ids == ref, prompt[:60]
        methods, ks = r.stats["auto_methods"], r.stats["auto_num_draft_tokens"]
        assert len(methods) == len(ks) == r.stats["num_steps"]  # one choice per step
        assert set(methods) <= SINGLES and all(0 <= k <= 4 for k in ks)
        assert all((k == 0) == (m == "none") for m, k in zip(methods, ks))
        assert r.stats["num_draft_tokens_total"] <= sum(ks)  # a proposer drafts at most the k auto chose
        trees, widths = r.stats["auto_draft_trees"], r.stats["auto_tree_top_k"]
        assert len(trees) == len(widths) == len(ks) and all(k > 1 for t, k in zip(trees, ks) if t)
        # a model proposer's trees take a width auto chose (AUTO_TREE_TOP_KS); chains and model-free trees none
        assert all((w in (2, 4, 8)) == (t and m not in ("suffix", "ngram")) for t, w, m in zip(trees, widths, methods))
        steps += len(methods)
        chosen |= set(methods)
    assert chosen - {"none"}  # it speculated somewhere
    deadline = time.monotonic() + 10  # generate exports its metrics when a request ends, after its last response
    while True:
        after = _auto_steps(server.metrics_url)
        if sum(after.values()) - sum(before.values()) >= steps or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert sum(after.values()) - sum(before.values()) == steps  # a counter per chosen method, every step counted
    assert all(after[m] >= before[m] for m in SINGLES)
    trees = sum(_auto_steps(server.metrics_url, "spec_decode_auto_tree_steps_total").values()) - trees_before
    assert 0 < trees <= steps


def test_auto_concurrent_streams_each_equal_target_greedy(server, greedy_references):
    """Four auto streams at once: their rounds are planned together (the controller budgets the round)."""
    out: dict[int, list[int]] = {}
    errors: list[BaseException] = []

    def run(i, prompt):
        try:
            out[i] = stream_generate(server.grpc_url, prompt, N_TOKENS, speculative_method="auto").output_ids
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=run, args=(i, p)) for i, (p, _) in enumerate(greedy_references[:4])]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert not errors
    assert [out[i] for i in range(4)] == [ref for _, ref in greedy_references[:4]]


def test_auto_through_http_generate(server, greedy_references):
    """auto over HTTP generate on a fresh server's history: the target's greedy tokens, and what it chose per step."""
    prompt, ref = greedy_references[0]
    body = {"text_input": prompt, "max_tokens": N_TOKENS, "speculative_method": "auto"}
    r = requests.post(f"http://{server.http_url}/v2/models/generate/generate", json=body, timeout=300)
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["output_ids"] == ref and len(out["auto_methods"]) == out["num_steps"]
    assert set(out["auto_methods"]) <= {"none", "ngram", "suffix", "draft", "eagle", "eagle3", "medusa",
                                        "mlp_speculator", "arctic"}
