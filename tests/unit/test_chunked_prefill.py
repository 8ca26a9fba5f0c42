"""spec_decode.scheduler.chunked_prefill: a round's token budget over running steps and prompt chunks, spent by the
target where its cache is known; outputs unchanged."""

import random

import pytest
import torch

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
from spec_decode.scheduler.chunked_prefill import plan_round, round_results


def _step(seq_id, n_ids, cached, k, method="suffix", processors=None):
    return StepInputs(seq_id, list(range(n_ids)), k, method, SamplingParams(), 0, processors=processors,
                      cached_len=cached)


def test_running_steps_first_then_prompts_with_their_share_of_the_budget():
    running = [_step(1, 300, 299, 4), _step(2, 200, 199, 4)]  # 5 positions each
    new = [_step(3, 1500, 0, 4), _step(4, 800, 0, 4)]
    submitted = [StepInputs(**s.__dict__) for s in running + new]
    plan = plan_round(running + new, 64)
    assert plan[0] is running[0] and plan[1] is running[1]
    share = plan[2]
    assert share is not None and share.token_ids == new[0].token_ids and share.num_scheduled_tokens == 54
    assert share.num_draft_tokens == 0 and share.step == new[0].step  # no room for drafts: none asked
    assert plan[3] is None  # the budget is spent: it waits
    assert running + new == submitted  # nothing submitted was changed


def test_the_first_prompt_always_progresses_and_a_fitting_prompt_keeps_its_drafts():
    busy = [_step(s, 100, 99, 7) for s in range(12)]  # 96 positions > the budget
    (*_, share) = plan_round(busy + [_step(99, 500, 0, 4)], 64)
    assert share is not None and share.num_scheduled_tokens == 16  # a quarter of the budget
    last = _step(5, 300, 280, 4)  # 20 prompt tokens left + 4 drafts
    (whole,) = plan_round([last], 64)
    assert whole is not None and (whole.num_draft_tokens, whole.num_scheduled_tokens) == (4, 64)
    (fewer,) = plan_round([last], 22)  # the prompt fits, two drafts do
    assert fewer is not None and fewer.token_ids == last.token_ids and fewer.num_draft_tokens == 2
    assert plan_round([_step(6, 1000, 0, 4)], 0)[0] == _step(6, 1000, 0, 4)  # no budget: whole, no share


def test_prompt_logprobs_requests_are_not_chunked():
    spec = ProcessorSpec(1000, prompt_logprobs=0)
    whole = _step(7, 1000, 0, 0, processors=spec)
    assert plan_round([whole], 64) == [whole]


def test_round_results_map_chunks_and_waits_to_prefilled():
    inps = [_step(1, 300, 299, 4), _step(2, 1500, 0, 4), _step(3, 900, 100, 4)]
    plan = plan_round(inps, 64)
    assert plan[1] is not None and plan[1].num_scheduled_tokens == 59 and plan[2] is None
    ok, chunk = StepResult([1, 2], 4), StepResult([], 0, cached_tokens=32, forward_seconds=0.1)
    out = round_results(inps, plan, [ok, chunk])
    assert out[0] is ok and out[1].prefilled == 32 + 59 and not out[1].output_ids and out[2].prefilled == 100
    assert out[1].forward_seconds == 0.1
    err = RuntimeError("boom")
    assert round_results(inps, plan, [ok, err])[1] is err
    with pytest.raises(ValueError, match="1 results for the 2"):
        round_results(inps, plan, [ok])


def test_the_target_spends_the_share_past_what_its_cache_holds(tiny_lm):
    """TargetScorer.chunk_end and CachedCausalLM.held_prefix_len: a prompt whose leading blocks another sequence left
    in the prefix cache runs whole within a share that its full length would not fit; an uncached one is cut; after
    the pool evicted the blocks, the same prompt is cut again (the cache is asked, never guessed)."""
    rng = random.Random(1)
    prompt = [rng.randrange(97) for _ in range(100)]
    lm = CachedCausalLM(tiny_lm, max_sequences=2, block_size=16, max_tokens=160)
    scorer = TargetScorer(lm)
    assert lm.held_prefix_len(1, prompt) == 0 and scorer.chunk_end(1, prompt, 0, None, 40) == 40
    (chunk,) = scorer.score_batch([(1, prompt[:40], [], SamplingParams())])
    assert chunk.cached == 0 and lm.held_prefix_len(1, prompt) == 40  # its own pages (one partial)
    assert scorer.chunk_end(1, prompt, 0, None, 40) == 80  # the next chunk goes on from there
    (rest,) = scorer.score_batch([(1, prompt, [], SamplingParams())])
    assert rest.cached == 40
    lm.release(1)  # its full pages stay cached for prefix reuse
    other = prompt[:96] + [5, 6, 7]
    assert lm.held_prefix_len(2, other) == 96 and scorer.chunk_end(2, other, 0, None, 8) is None
    assert scorer.chunk_end(2, other, 2, None, 8) is None  # a step with drafts is never cut
    (hit,) = scorer.score_batch([(2, other, [], SamplingParams())])
    assert hit.cached == 96  # what the peek said
    lm.release(2)
    for s in range(3, 6):  # other prompts fill the pool: the cached pages go
        scorer.score_batch([(s, [rng.randrange(97) for _ in range(150)], [], SamplingParams())])
    assert lm.held_prefix_len(7, other) < 96 and scorer.chunk_end(7, other, 0, None, 8) is not None


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


def test_a_prompt_another_sequence_left_cached_gets_its_first_token_in_one_round(tiny_lm, real_tokenizer):
    """Through the round loop (Scheduler.run_round, as generate's): with a budget of 32, a 150-token prompt takes
    chunks; the same prompt again, its blocks in the target's prefix cache, runs whole in its first round; outputs
    equal."""
    rng = random.Random(2)
    prompt = [rng.randrange(97) for _ in range(150)]
    step = LocalStep({}, TargetScorer(CachedCausalLM(tiny_lm, max_tokens=4096)))
    rounds, outs = [], []
    for seq_id in (1, 2):
        gen = Generation(seq_id, prompt, GenerationRequest("x", 6, speculative_method="none"), real_tokenizer, [],
                         512, 0)
        calls: list[int] = []
        inner = step.scorer.score_batch

        def counted(items, calls=calls, inner=inner):
            calls.append(len(items[0][1]))  # the tokens of the round's forward
            return inner(items)

        step.scorer.score_batch = counted
        run_local(gen, step, max_num_batched_tokens=32)
        step.scorer.score_batch = inner
        rounds.append(calls)
        outs.append(gen.output_ids)
    assert rounds[0][:5] == [32, 64, 96, 128, 150]  # chunks of the uncached prompt, then its first step
    assert rounds[1][0] == 150 and len(rounds[1]) == 6  # cached: the first round is its first step
    assert outs[0] == outs[1]
