"""Scheduling through the real server (fixture ``server``: generate's default ``max_num_batched_tokens`` and the
target's prefix caching): a long prompt is prefilled in chunks while a running stream keeps streaming, and its greedy
tokens are the target's own; a prompt that repeats a long prefix reuses the target's cached blocks (the metrics show
the hit and the reused tokens) and its output is the target's, alone and under concurrency; a draft LM with fewer
positions than the target drafts nothing past them, on a server of its own."""

import inspect
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import torch

from client.datasets import humaneval_prompts
from client.generate import stream_generate
from client.metrics import scrape, value


def _source_text(n_chars: int, skip: int = 0) -> str:
    """Python standard-library source (it ships with every Python), ``n_chars`` characters from ``skip`` on."""
    return inspect.getsource(inspect)[skip : skip + n_chars]


def _greedy(real_model, real_tokenizer, prompt: str, n: int) -> list[int]:
    ids = real_tokenizer(prompt, return_tensors="pt")["input_ids"]
    with torch.inference_mode():
        out = real_model.generate(ids, max_new_tokens=n, do_sample=False)[0, ids.shape[1]:].tolist()
    eos = real_tokenizer.eos_token_id
    return out[: out.index(eos)] if eos in out else out


def test_a_long_prompt_is_prefilled_in_chunks_while_a_stream_keeps_streaming(server, real_model, real_tokenizer):
    """A running stream gets responses while a ~1,300-token prompt is prefilled (in one piece it would get none in
    that window); the long prompt's greedy tokens equal the target's own."""
    long_prompt = _source_text(4200, skip=1000) + "\n\ndef "
    n_long = len(real_tokenizer(long_prompt)["input_ids"])
    assert n_long >= 1100
    arrivals: list[float] = []
    started = threading.Event()

    def on_text(_text):
        arrivals.append(time.perf_counter())
        if len(arrivals) >= 3:
            started.set()

    with ThreadPoolExecutor(1) as pool:
        running = pool.submit(stream_generate, server.grpc_url, humaneval_prompts(1)[0], 160, on_text=on_text,
                              speculative_method="none", ignore_eos=True)
        assert started.wait(120)
        sent = time.perf_counter()
        r = stream_generate(server.grpc_url, long_prompt, 6, speculative_method="suffix")
        first_token = sent + r.ttft_s
        stream = running.result(timeout=600)
    during = [t for t in arrivals if sent < t < first_token]
    assert len(stream.output_ids) == 160
    assert len(during) >= 2, (f"the running stream got {len(during)} responses during the {r.ttft_s:.2f} s prefill "
                              f"of {n_long} tokens")
    assert r.output_ids == _greedy(real_model, real_tokenizer, long_prompt, 6)


def test_a_repeated_long_prefix_is_reused_with_the_target_s_output(server, real_model, real_tokenizer):
    """Three prompts sharing a >= 1,000-token prefix: the first computes it, the other two (sent concurrently)
    reuse its blocks; the metrics count the hits and reused tokens; every output is the target's own greedy one."""
    prefix = _source_text(5000, skip=9000)
    prompts = [prefix + f"\n\n# Task {i}: write a function that returns {i} squared.\ndef " for i in range(3)]
    assert len(real_tokenizer(prefix)["input_ids"]) >= 1000
    before = scrape(server.metrics_url)
    first = stream_generate(server.grpc_url, prompts[0], 8, speculative_method="none")
    with ThreadPoolExecutor(2) as pool:
        others = list(pool.map(lambda p: stream_generate(server.grpc_url, p, 8, speculative_method="suffix"),
                               prompts[1:]))
    deadline = time.time() + 30
    while True:  # the export can lag the responses
        after = scrape(server.metrics_url)
        hits = (value(after, "spec_decode_target_prefix_cache_hits_total")
                - value(before, "spec_decode_target_prefix_cache_hits_total"))
        reused = (value(after, "spec_decode_target_prefix_cache_reused_tokens_total")
                  - value(before, "spec_decode_target_prefix_cache_reused_tokens_total"))
        if (hits >= 2 and reused >= 1800) or time.time() > deadline:
            break
        time.sleep(0.5)
    assert hits >= 2 and reused >= 1800, (hits, reused)
    assert 0 < value(after, "spec_decode_target_prefix_cache_hit_rate") <= 1
    assert value(after, "spec_decode_target_kv_cache_max_tokens") > 0
    assert value(after, "spec_decode_target_kv_cache_allocated_tokens") <= value(
        after, "spec_decode_target_kv_cache_max_tokens")
    for prompt, r in zip(prompts, [first, *others]):
        assert r.output_ids == _greedy(real_model, real_tokenizer, prompt, 8)


def test_a_draft_lm_with_fewer_positions_drafts_nothing_past_them(tmp_path, real_model_dir, real_model,
                                                                 real_tokenizer):
    """A draft LM whose config takes 48 positions, served as ``draft``: a sequence drafts while its next positions fit
    and drafts nothing after (its steps do not fail), a prompt already past them never drafts, and both outputs are
    the target's own greedy tokens."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from spec_decode.launcher import TritonServer, draft_overrides, prepare_repository

    config = AutoConfig.from_pretrained(real_model_dir)
    config.num_hidden_layers, config.max_position_embeddings = 1, 48
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "short_draft")
    overrides = draft_overrides(str(tmp_path / "short_draft"))
    overrides["draft_model"]["draft_min_token_prob"] = "0"  # a random draft is never confident: draft every slot
    short = "def add(a, b):\n"
    long = _source_text(400, skip=2000)
    assert len(real_tokenizer(short)["input_ids"]) < 40 < len(real_tokenizer(long)["input_ids"]) - 10
    with TritonServer(prepare_repository(overrides), log_path=tmp_path / "server.log") as srv:
        srv.wait_ready(timeout=600)
        grows = stream_generate(srv.grpc_url, short, 48, speculative_method="draft", num_draft_tokens=4,
                                ignore_eos=True)
        past = stream_generate(srv.grpc_url, long, 8, speculative_method="draft", num_draft_tokens=4)
    assert len(grows.output_ids) == 48 and grows.stats["num_draft_tokens_total"] > 0
    assert grows.stats["num_draft_tokens_total"] < 4 * grows.stats["num_steps"]  # nothing drafted past 48 positions
    ids = real_tokenizer(short, return_tensors="pt")["input_ids"]
    with torch.inference_mode():
        ref = real_model.generate(ids, max_new_tokens=48, do_sample=False, eos_token_id=None,
                                  pad_token_id=0)[0, ids.shape[1]:].tolist()
    assert grows.output_ids == ref
    assert past.stats["num_draft_tokens_total"] == 0
    assert past.output_ids == _greedy(real_model, real_tokenizer, long, 8)


def test_several_target_instances_and_an_eviction_keep_chunked_prefill_exact(tmp_path, real_model, real_tokenizer):
    """Two target_model instances, each with a pool of 2,048 tokens: rounds of one sequence may go to either, so
    neither generate nor the other instance knows what a given round's target holds. Long prompts (each ~1,100
    tokens, about six times the round's budget) are prefilled in shares the target spends past its own cache hit: the
    first prompt, the same again, two others at once (which evict its pages), and the first once more. Every output
    is the target's own greedy one and every request finishes."""
    from spec_decode.launcher import TritonServer, prepare_repository

    repo = prepare_repository({"target_model": {"kv_cache_max_tokens": "2048"}})
    cfg = repo / "target_model" / "config.pbtxt"
    text = cfg.read_text()
    assert "instance_group [ { count: 1 kind: KIND_CPU } ]" in text
    cfg.write_text(text.replace("instance_group [ { count: 1 kind: KIND_CPU } ]",
                                "instance_group [ { count: 2 kind: KIND_CPU } ]"))
    prompts = [_source_text(4000, skip=skip) + "\n\ndef " for skip in (3000, 40000, 60000)]
    assert all(len(real_tokenizer(p)["input_ids"]) >= 900 for p in prompts)
    refs = [_greedy(real_model, real_tokenizer, p, 6) for p in prompts]
    with TritonServer(repo, log_path=tmp_path / "server.log") as srv:
        srv.wait_ready(timeout=600)
        got = [stream_generate(srv.grpc_url, prompts[0], 6, speculative_method="none") for _ in range(2)]
        with ThreadPoolExecutor(2) as pool:
            got += list(pool.map(lambda p: stream_generate(srv.grpc_url, p, 6, speculative_method="suffix"),
                                 prompts[1:]))
        got.append(stream_generate(srv.grpc_url, prompts[0], 6, speculative_method="suffix"))
        rounds = value(scrape(srv.metrics_url), "spec_decode_rounds_total")
    assert [r.output_ids for r in got] == [refs[0], refs[0], refs[1], refs[2], refs[0]]
    assert rounds >= 5 * 6  # every request's steps ran (and the first prompt's chunks before them)
