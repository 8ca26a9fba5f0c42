"""spec_decode.engine.kv_cache: prefix caching across sequences (hash chain over full blocks) and the token budget."""

import random
import subprocess
import sys
import textwrap

import torch

from spec_decode.engine.blocks import block_hashes
from spec_decode.engine.kv_cache import CachedCausalLM


def _full_logits(model, ids):
    with torch.inference_mode():
        return model(input_ids=torch.tensor([ids])).logits[0]


def test_block_hashes_are_a_chain_over_full_blocks():
    a = block_hashes(list(range(40)), 16)
    assert len(a) == 2  # two full blocks; the last 8 tokens are not a block
    assert block_hashes(list(range(33)), 16) == a
    b = block_hashes([99] + list(range(1, 40)), 16)
    assert b[0] != a[0] and b[1] != a[1]  # block 1 has the same ids, but its key depends on block 0
    prev = a[:1]
    assert block_hashes(list(range(40)), 16, 1, prev) == a and prev == a  # extended in place from block 1


def test_a_shared_prefix_is_copied_not_computed_and_logits_equal_a_full_forward(tiny_lm):
    rng = random.Random(0)
    prefix = [rng.randrange(97) for _ in range(70)]
    lm = CachedCausalLM(tiny_lm, max_sequences=4, block_size=16)
    first = prefix + [5, 6, 7]
    lm.logits(1, first, 1)
    assert lm.prefix_stats.queries == 1 and lm.prefix_stats.hits == 0
    second = prefix + [8, 9]
    computed = []
    forward = lm._forward
    lm._forward = lambda batch: computed.append(len(batch[0][3]) - batch[0][4]) or forward(batch)
    got = lm.logits(2, second, 2)
    torch.testing.assert_close(got, _full_logits(tiny_lm, second)[-2:], atol=1e-5, rtol=1e-4)
    assert lm.prefix_stats.hits == 1 and lm.prefix_stats.reused_tokens == 64  # 4 full blocks of the 70 shared
    assert computed == [len(second) - 64]  # only the tokens after the copied blocks were computed


def test_released_caches_are_reused_then_evicted_lru(tiny_lm):
    rng = random.Random(1)
    lm = CachedCausalLM(tiny_lm, max_sequences=2, block_size=8)
    prompts = {s: [rng.randrange(97) for _ in range(40)] for s in range(4)}
    for s in range(3):
        lm.logits(s, prompts[s], 1)
        lm.release(s)
    assert len(lm) == 0 and lm.retired_sequences() == 2  # at most max_sequences released caches: 0 left first
    lm.logits(10, prompts[2] + [1, 2, 3], 1)  # reuses 2's blocks
    assert lm.prefix_stats.hits == 1 and lm.prefix_stats.reused_tokens == 40
    lm.logits(11, prompts[0] + [1], 1)  # 0's cache was evicted: computed again
    assert lm.prefix_stats.hits == 1
    torch.testing.assert_close(lm.logits(11, prompts[0] + [1], 1), _full_logits(tiny_lm, prompts[0] + [1])[-1:],
                               atol=1e-5, rtol=1e-4)


def test_rolled_back_blocks_are_not_reused(tiny_lm):
    """Blocks holding drafts that a later step rejected leave the index: another sequence never copies stale keys."""
    rng = random.Random(2)
    lm = CachedCausalLM(tiny_lm, max_sequences=4, block_size=4)
    base = [rng.randrange(97) for _ in range(10)]
    lm.logits(1, base + [1, 2, 3, 4, 5, 6], 7)  # drafts fill blocks 2 and 3
    lm.logits(1, base + [9], 1)  # rejected: cropped back to 10 tokens (+1)
    other = base + [1, 2, 3, 4, 5, 6, 7]
    got = lm.logits(2, other, 1)
    torch.testing.assert_close(got, _full_logits(tiny_lm, other)[-1:], atol=1e-5, rtol=1e-4)
    assert lm.prefix_stats.reused_tokens == 8  # blocks 0 and 1 only (block 2 is no longer held by sequence 1)


def test_prefix_caching_off_keeps_nothing_after_release(tiny_lm):
    lm = CachedCausalLM(tiny_lm, prefix_caching=False)
    lm.logits(1, list(range(40)), 1)
    lm.release(1)
    lm.logits(2, list(range(40)), 1)
    assert lm.retired_sequences() == 0 and lm.prefix_stats.queries == 0 and lm.allocated_tokens() > 0


def test_the_token_budget_holds_across_many_sequences(tiny_lm):
    """Driven far past ``max_tokens`` (running and released caches), the positions allocated stay within it after
    every forward, and so do the buffers' bytes (max_tokens x kv_bytes_per_token); outputs stay exact."""
    rng = random.Random(3)
    budget = 2048
    lm = CachedCausalLM(tiny_lm, max_sequences=8, max_tokens=budget)
    running: dict[int, list[int]] = {}
    for s in range(24):
        running[s] = [rng.randrange(97) for _ in range(rng.randint(20, 200))]
        for t in list(running):
            running[t] += [rng.randrange(97)]
        calls = [(t, list(ids), 1) for t, ids in list(running.items())[-3:]]
        for (_, ids, _), got in zip(calls, lm.logits_batch(calls)):
            torch.testing.assert_close(got, _full_logits(tiny_lm, ids)[-1:], atol=1e-5, rtol=1e-4)
        assert lm.allocated_tokens() <= budget
        held = sum(buf.numel() * buf.element_size() for e in [*lm._entries.values(), *lm._retired.values()]
                   for buf in [*e.slots.keys, *e.slots.values] if buf is not None)
        assert held <= budget * lm.kv_bytes_per_token()
        if s % 3 == 0:
            lm.release(s - 1)
            running.pop(s - 1, None)
    assert lm.prefix_stats.queries > 0


def test_process_memory_stays_within_the_budget_estimate(tmp_path):
    """In a fresh process: a model with 16 KiB of keys and values per token, driven with 24,000 tokens of sequences
    (60 of 400 tokens) under a 4,096-token budget, grows its resident memory by less than twice the budget's
    estimate; without a budget the same feed grows it by far more (so this test can fail)."""
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
