"""spec_decode.engine.kv_cache: prefix caching across sequences (the page chain of full blocks) and the token budget."""

import random
import subprocess
import sys
import textwrap

import torch

from spec_decode.engine.kv_cache import CachedCausalLM


def _full_logits(model, ids):
    with torch.inference_mode():
        return model(input_ids=torch.tensor([ids])).logits[0]


def test_a_shared_prefix_is_shared_not_computed_and_logits_equal_a_full_forward(tiny_lm):
    rng = random.Random(0)
    prefix = [rng.randrange(97) for _ in range(70)]
    lm = CachedCausalLM(tiny_lm, max_sequences=4, block_size=16, max_tokens=1024)
    first = prefix + [5, 6, 7]
    lm.logits(1, first, 1)
    assert lm.prefix_stats.queries == 1 and lm.prefix_stats.hits == 0
    second = prefix + [8, 9]
    computed = []
    forward = lm._forward
    lm._forward = lambda rows: computed.append(len(rows[0].new_ids)) or forward(rows)
    got = lm.logits(2, second, 2)
    torch.testing.assert_close(got, _full_logits(tiny_lm, second)[-2:], atol=1e-5, rtol=1e-4)
    assert lm.prefix_stats.hits == 1 and lm.prefix_stats.reused_tokens == 64  # 4 full blocks of the 70 shared
    assert computed == [len(second) - 64]  # only the tokens after the shared pages were computed
    a, b = lm._seqs[1].pages, lm._seqs[2].pages
    assert a[:4] == b[:4] and a[4] != b[4]  # the same pages, not copies
    assert all(lm.pages.ref[p] == 2 for p in a[:4])


def test_copy_on_write_of_a_shared_page(tiny_lm):
    """Two sequences share a page; one rolls back into it and writes other tokens: it gets a copy of the kept part,
    and the other's keys and values (and logits) are untouched."""
    rng = random.Random(5)
    prefix = [rng.randrange(97) for _ in range(40)]
    lm = CachedCausalLM(tiny_lm, max_sequences=4, block_size=8, max_tokens=1024)
    lm.logits(1, prefix + [1], 1)
    lm.logits(2, prefix + [2], 1)
    shared = lm._seqs[2].pages[4]
    assert lm._seqs[1].pages[4] == shared and lm.pages.ref[shared] == 2  # block 4: positions 32..39
    rolled = prefix[:35] + [3, 4, 5, 6]  # sequence 2 keeps 35 positions: 3 of the shared page, then writes
    torch.testing.assert_close(lm.logits(2, rolled, 4), _full_logits(tiny_lm, rolled)[-4:], atol=1e-5, rtol=1e-4)
    assert lm._seqs[2].pages[4] != shared and lm._seqs[1].pages[4] == shared and lm.pages.ref[shared] == 1
    ids = prefix + [1, 9]
    torch.testing.assert_close(lm.logits(1, ids, 2), _full_logits(tiny_lm, ids)[-2:], atol=1e-5, rtol=1e-4)


def test_released_pages_are_reused_then_evicted_lru(tiny_lm):
    """Released sequences' full pages stay cached for later prompts until the pool needs them, least recently used
    first out."""
    rng = random.Random(1)
    lm = CachedCausalLM(tiny_lm, max_sequences=4, block_size=8, max_tokens=128)  # 16 pages
    prompts = {s: [rng.randrange(97) for _ in range(40)] for s in range(4)}
    for s in range(3):  # 5 full pages each, 6 pages held while running
        lm.logits(s, prompts[s], 1)
        lm.release(s)
    assert len(lm) == 0 and lm.cached_pages() == 15  # 3 x 5 full pages, the free partial pages not among them
    lm.logits(10, prompts[2] + [1, 2, 3], 1)  # reuses 2's pages: now the most recently used
    assert lm.prefix_stats.hits == 1 and lm.prefix_stats.reused_tokens == 40
    lm.release(10)
    lm.logits(11, prompts[3], 1)  # needs 5 pages: the free one, then the least recently used cached ones (0's)
    lm.release(11)
    lm.logits(12, prompts[2] + [7], 1)
    assert lm.prefix_stats.hits == 2  # 2's pages are still cached
    lm.logits(13, prompts[0] + [1], 1)
    assert lm.prefix_stats.hits == 2  # 0's were evicted: computed again
    torch.testing.assert_close(lm.logits(13, prompts[0] + [1], 1), _full_logits(tiny_lm, prompts[0] + [1])[-1:],
                               atol=1e-5, rtol=1e-4)


def test_rewritten_pages_are_not_reused(tiny_lm):
    """A page written again after a rollback (a rejected draft replaced) leaves the index, and so do the pages
    registered after it: another sequence never shares stale keys."""
    rng = random.Random(2)
    lm = CachedCausalLM(tiny_lm, max_sequences=4, block_size=4, max_tokens=1024)
    base = [rng.randrange(97) for _ in range(10)]
    lm.logits(1, base + [1, 2, 3, 4, 5, 6], 7)  # drafts fill blocks 2 and 3
    lm.logits(1, base + [9], 1)  # rejected: back to 10 tokens (+1), block 2's page written again
    other = base + [1, 2, 3, 4, 5, 6, 7]
    got = lm.logits(2, other, 1)
    torch.testing.assert_close(got, _full_logits(tiny_lm, other)[-1:], atol=1e-5, rtol=1e-4)
    assert lm.prefix_stats.reused_tokens == 8  # blocks 0 and 1 only


def test_prefix_caching_off_keeps_nothing_after_release(tiny_lm):
    lm = CachedCausalLM(tiny_lm, prefix_caching=False, max_tokens=1024)
    lm.logits(1, list(range(40)), 1)
    lm.release(1)
    lm.logits(2, list(range(40)), 1)
    assert lm.cached_pages() == 0 and lm.prefix_stats.queries == 0 and lm.allocated_tokens() > 0


def test_the_token_budget_holds_across_many_sequences(tiny_lm):
    """Driven far past ``max_tokens`` (running and released sequences), the positions in use stay within it after
    every forward, the pool's bytes are the budget's (max_tokens x kv_bytes_per_token, plus the trash page), and
    outputs stay exact."""
    rng = random.Random(3)
    budget = 2048
    lm = CachedCausalLM(tiny_lm, max_sequences=8, max_tokens=budget)
    assert lm.pool.nbytes == (budget + lm.block_size) * lm.kv_bytes_per_token()
    running: dict[int, list[int]] = {}
    for s in range(24):
        running[s] = [rng.randrange(97) for _ in range(rng.randint(20, 200))]
        for t in list(running):
            running[t] += [rng.randrange(97)]
        calls = [(t, list(ids), 1) for t, ids in list(running.items())[-3:]]
        for (_, ids, _), got in zip(calls, lm.logits_batch(calls)):
            torch.testing.assert_close(got, _full_logits(tiny_lm, ids)[-1:], atol=1e-5, rtol=1e-4)
        assert lm.allocated_tokens() <= budget
        if s % 3 == 0:
            lm.release(s - 1)
            running.pop(s - 1, None)
    assert lm.prefix_stats.queries > 0


def test_process_memory_stays_within_the_budget_estimate(tmp_path):
    """In a fresh process: a model with 16 KiB of keys and values per token, driven with 24,000 tokens of sequences
    (60 of 400 tokens) under a 4,096-token budget, grows its resident memory by less than twice the budget's
    estimate; with the pool sized from the machine's memory (0) the same feed grows it by far more, as the released
    sequences' pages stay cached (so this test can fail)."""
    script = textwrap.dedent("""
        import random, sys
        import torch
        from transformers import LlamaConfig, LlamaForCausalLM
        from spec_decode.engine.kv_cache import CachedCausalLM
        torch.manual_seed(0)
        torch.set_num_threads(1)
        cfg = LlamaConfig(vocab_size=97, hidden_size=256, intermediate_size=64, num_hidden_layers=8,
                          num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=2048)
        model = LlamaForCausalLM(cfg).eval()
        lm = CachedCausalLM(model, max_sequences=64, max_tokens=int(sys.argv[1]))
        def rss():
            with open("/proc/self/statm") as f:
                return int(f.read().split()[1]) * 4096
        rng = random.Random(0)
        lm.logits(0, [1] * 50, 1)
        lm.release(0)
        base = rss()
        peak = 0
        for s in range(1, 61):
            lm.logits(s, [rng.randrange(97) for _ in range(400)], 1)
            lm.release(s)
            peak = max(peak, rss() - base)
            if peak > int(sys.argv[2]):
                break
        print(lm.kv_bytes_per_token(), peak)
    """)
    def run(budget, stop_above):
        out = subprocess.run([sys.executable, "-c", script, str(budget), str(stop_above)], capture_output=True,
                             text=True, timeout=300, check=True)
        return [int(x) for x in out.stdout.split()]

    estimate = 4096 * 2 * 8 * 4 * 64 * 4  # 64 MiB at 16 KiB per token
    per_token, bounded = run(4096, 10 * estimate)
    assert per_token == 2 * 8 * 4 * 64 * 4
    assert bounded < 2 * estimate, (bounded, estimate)
    _, unbounded = run(0, 3 * estimate)  # stops once past 3x (64 released caches of 656 positions would be ~656 MiB)
    assert unbounded > 3 * estimate, (unbounded, estimate)
