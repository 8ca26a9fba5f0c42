"""spec_decode.chunked_prefill: a round's token budget over running steps and prompt chunks; outputs unchanged."""

import random

import pytest
import torch

from spec_decode.chunked_prefill import new_positions, plan_round, round_results
from spec_decode.engine.kv_cache import CachedCausalLM
from spec_decode.engine.model_loading import load_causal_lm
from spec_decode.engine.scorer import TargetScorer
from spec_decode.generation import Generation
from spec_decode.in_process import LocalStep, run_local
from spec_decode.processors import ProcessorSpec
from spec_decode.proposers import METHODS, build_proposers
from spec_decode.proposers.speculators import aux_hidden_state_layers
from spec_decode.protocol import StepInputs, StepResult
from spec_decode.request import GenerationRequest
from spec_decode.sampling import SamplingParams


def _step(seq_id, n_ids, cached, k, method="suffix", processors=None):
    return StepInputs(seq_id, list(range(n_ids)), k, method, SamplingParams(), 0, processors=processors,
                      cached_len=cached)


def test_running_steps_first_then_prompts_in_chunks_within_the_budget():
    running = [_step(1, 300, 299, 4), _step(2, 200, 199, 4)]  # 5 positions each
    new = [_step(3, 1500, 0, 4), _step(4, 800, 0, 4)]
    plan = plan_round(running + new, 64)
    assert plan[0] is running[0] and plan[1] is running[1]
    chunk = plan[2]
    assert chunk is not None and chunk.token_ids == new[0].token_ids[:54] and chunk.num_draft_tokens == 0
    assert chunk.method == "none" and chunk.processors is None and chunk.step == new[0].step
    assert plan[3] is None  # the budget is spent: it waits
    assert sum(new_positions(p) for p in plan if p is not None) == 64


def test_the_first_prompt_always_progresses_and_a_fitting_prompt_runs_whole():
    busy = [_step(s, 100, 99, 7) for s in range(12)]  # 96 positions > the budget
    (*_, chunk) = plan_round(busy + [_step(99, 500, 0, 4)], 64)
    assert chunk is not None and len(chunk.token_ids) == 16  # a quarter of the budget
    last = _step(5, 300, 280, 4)  # 20 prompt tokens left + 4 drafts
    assert plan_round([last], 64) == [last]
    (fewer,) = plan_round([last], 22)  # the prompt fits, two drafts do
    assert fewer is not None and fewer.token_ids == last.token_ids and fewer.num_draft_tokens == 2
    assert plan_round([_step(6, 1000, 0, 4)], 0)[0].token_ids == list(range(1000))  # no budget: whole


def test_prompt_logprobs_requests_are_not_chunked():
    spec = ProcessorSpec(1000, prompt_logprobs=0)
    whole = _step(7, 1000, 0, 0, processors=spec)
    assert plan_round([whole], 64) == [whole]


def test_round_results_map_chunks_and_waits_to_prefilled():
    inps = [_step(1, 300, 299, 4), _step(2, 1500, 0, 4), _step(3, 900, 100, 4)]
    plan = [inps[0], inps[1].__class__(**{**inps[1].__dict__, "token_ids": inps[1].token_ids[:40]}), None]
    ok, chunk = StepResult([1, 2], 4), StepResult([9], 0)
    out = round_results(inps, plan, [ok, chunk])
    assert out[0] is ok and out[1].prefilled == 40 and not out[1].output_ids and out[2].prefilled == 100
    err = RuntimeError("boom")
    assert round_results(inps, plan, [ok, err])[1] is err
    with pytest.raises(ValueError, match="1 results for the 2"):
        round_results(inps, plan, [ok])


def test_chunked_prefill_gives_the_tokens_of_one_piece_prefill_for_every_method(tiny_dir, tiny_heads_params,
                                                                                real_tokenizer):
    """Every registered method, greedy, a 150-token prompt in chunks of at most 32 positions: the output equals the
    one-piece run's, chunks do not count as steps, and the target computed the prompt in chunks."""
    torch.set_num_threads(1)
    rng = random.Random(0)
    prompt = [rng.randrange(97) for _ in range(150)]
    params = {"draft_model_path": str(tiny_dir), "device": "cpu", "dtype": "float32", "suffix_backend": "python",
              "suffix_max_cached_requests": "0", "hybrid_fallback": "draft", "draft_min_token_prob": "0",
              "enable_prefix_caching": "false", **tiny_heads_params}
    served = build_proposers(params)
    assert ("none", *served) == METHODS
    # the target returns the EAGLE-3 head's layers beside its last hidden state (its own copy: the hooks stay on it)
    lm = CachedCausalLM(load_causal_lm(tiny_dir, torch.device("cpu"), torch.float32), prefix_caching=False,
                        aux_layers=tuple(aux_hidden_state_layers(params["speculator_path"], 2)))
    step = LocalStep(served, TargetScorer(lm))
    computed = []
    forward = lm._forward
    lm._forward = lambda rows: computed.append(len(rows[0].new_ids)) or forward(rows)
    for method in METHODS:
        outs, steps = [], []
        for budget in (0, 32):
            computed.clear()
            gen = Generation(7, prompt, GenerationRequest("x", 24, speculative_method=method), real_tokenizer, [],
                             512, 0)
            run_local(gen, step, max_num_batched_tokens=budget)
            outs.append(gen.output_ids)
            steps.append(gen.stats.steps)
            if budget:
                assert max(computed) <= 32 and computed[:4] == [32, 32, 32, 32], (method, computed)
            else:
                assert computed[0] >= 150  # the prompt (and the drafts) in one forward
        assert outs[0] == outs[1] and len(outs[0]) == 24, method
        assert steps[0] == steps[1], method


def test_chunked_prefill_on_the_embedded_model(real_model, real_tokenizer):
    """The real model: a ~300-token prompt prefilled in 64-token chunks gives the greedy tokens of one piece."""
    torch.set_num_threads(2)
    text = "\n".join(f"def f{i}(x):\n    return x * {i} + {i * i}" for i in range(30)) + "\ndef f30(x):\n"
    prompt = real_tokenizer(text)["input_ids"]
    assert len(prompt) > 250
    step = LocalStep(build_proposers({"draft_model_path": "", "speculator_path": "", "suffix_backend": "python"}),
                     TargetScorer(CachedCausalLM(real_model, prefix_caching=False)))
    outs = []
    for budget in (0, 64):
        gen = Generation(3, prompt, GenerationRequest("x", 8, speculative_method="suffix"), real_tokenizer, [],
                         2048, 0)
        run_local(gen, step, max_num_batched_tokens=budget)
        outs.append(gen.output_ids)
    assert outs[0] == outs[1] and len(outs[0]) == 8


def test_the_prefix_tracker_counts_leading_blocks_the_target_was_sent():
    from spec_decode.chunked_prefill import PrefixTracker

    t = PrefixTracker(block_size=16, capacity_tokens=64)
    shared = list(range(50))
    assert t.cached_len(shared + [1, 2]) == 0
    t.add(shared + [7] * 30)  # 5 full blocks; the capacity keeps the last 4
    assert t.cached_len(shared + [1, 2]) == 0  # block 0 was forgotten first: no leading run
    t.add(shared)
    assert t.cached_len(shared + [1, 2]) == 48  # blocks 0..2 of the shared 50 tokens
    assert t.cached_len(shared[:33]) == 32  # at most all but the last token, whole blocks
    assert t.cached_len([9] + shared) == 0
    off = PrefixTracker(capacity_tokens=0)  # the target has no prefix caching
    off.add(shared)
    assert off.cached_len(shared + [1]) == 0
    # a new sequence that starts with the tracked blocks is budgeted only for the rest
    inp = StepInputs(1, shared + [1, 2], 4, "suffix", SamplingParams(), 0, cached_len=t.cached_len(shared + [1, 2]))
    assert new_positions(inp) == 52 - 48 + 4 and plan_round([inp], 32) == [inp]
