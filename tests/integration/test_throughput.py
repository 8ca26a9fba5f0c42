"""Throughput under concurrency through the real server: lockstep rounds batch concurrent sequences into one forward,
outputs stay those of solo runs, and the benchmark suite's perf_analyzer run works against generate."""

import threading

from client.datasets import humaneval_prompts
from client.generate import stream_generate
from client.metrics import scrape, value, wait_for


def _batching(server, model):
    s = scrape(server.metrics_url, prefix="nv_inference_")
    return (value(s, "nv_inference_count", model=model, version="1"),
            value(s, "nv_inference_exec_count", model=model, version="1"))


def _settle(server, models, before, rise):
    """Wait (client.metrics.wait_for, 10 s) until each model's nv_inference_count has risen by its `rise` over
    `before`: a sequence's release is sent just after its final response, and an ensemble's count moves only once its
    last step is done."""
    wait_for(server.metrics_url, lambda s: all(value(s, "nv_inference_count", model=m, version="1") - b >= r
                                               for m, b, r in zip(models, before, rise)),
             timeout_s=10, prefix="nv_inference_")


def test_concurrent_streams_step_in_rounds_that_share_one_target_forward(server):
    """4 greedy streams of equal length started together: (almost) every target execute holds all 4 sequences (one
    batched request per round), and each output equals the same request run alone."""
    prompts = humaneval_prompts(4)
    kw = dict(speculative_method="none", ignore_eos=True)
    settled = ("target_model", "spec_step")
    before_solo = [_batching(server, m)[0] for m in settled]
    solo = [stream_generate(server.grpc_url, p, 24, **kw).output_ids for p in prompts]
    # let the last solo release land (spec_step counts it once its verifier is done) before counting
    _settle(server, settled, before_solo, (4 * 24 + 4, 4))
    results = [None] * 4
    go = threading.Barrier(4)

    def run(i):
        go.wait()
        results[i] = stream_generate(server.grpc_url, prompts[i], 24, **kw).output_ids

    models = ("spec_step", "score_step", "verifier")
    counts = lambda: [_batching(server, m)[0] for m in models]  # noqa: E731
    (c0, e0), g0 = _batching(server, "target_model"), counts()
    threads = [threading.Thread(target=run, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(600)
    assert results == solo
    # one step per token per sequence, plus each sequence's release (sent just after its final response)
    _settle(server, settled, (c0, g0[0]), (4 * 24 + 4, 4))
    (c1, e1), g1 = _batching(server, "target_model"), counts()
    # greedy steps without drafts or log-probs go to target_model alone (no draft_model or verifier hop); the releases
    # go through spec_step (draft_model, target_model, verifier)
    assert c1 - c0 == 4 * 24 + 4 and [b - a for a, b in zip(g0, g1)] == [4, 0, 4]
    # 24 rounds if all 4 start in the same round (a sequence that arrives during another's first step joins the next
    # one) and the 4 releases: far from the 100 executes of unbatched steps
    assert e1 - e0 <= 24 + 4 + 4, (c1 - c0, e1 - e0)


def test_perf_analyzer_streams_generate_and_the_suite_reads_its_export(server, tmp_path):
    """The serving suite's perf_analyzer run (bench.perf_tools; gRPC, --streaming, concurrency 2) and the figures
    parsed from its profile export: every token of every request counted, one response per step."""
    from bench.perf_tools import run_perf_analyzer

    row = run_perf_analyzer(server.grpc_url, humaneval_prompts(3), "suffix", 4, 2, 4, 10, tmp_path)
    assert row["requests"] == 4 and row["tokens"] == 4 * 10  # ignore_eos: exactly max_tokens each
    hist = {int(n): c for n, c in row["tokens_per_step_histogram"].items()}
    assert sum(n * c for n, c in hist.items()) == row["tokens"]
    assert all(1 <= n <= 5 for n in hist)  # at most k + 1 tokens per step
    assert row["tokens_per_s"] > 0 and 0 < row["ttft_ms"] < row["latency_ms"] and row["itl_ms"] > 0
