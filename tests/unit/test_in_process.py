"""spec_decode.in_process: whole generations with the proposer, scorer and verifier objects called in process."""

import torch

from spec_decode.generation import Generation
from spec_decode.in_process import LocalStep, run_local
from spec_decode.kv_cache import CachedCausalLM
from spec_decode.proposers import DraftModelProposer, HybridProposer, NgramProposer, SuffixProposer
from spec_decode.request import GenerationRequest
from spec_decode.sampling import SamplingParams
from spec_decode.scorer import TargetScorer


def test_self_draft_greedy_equals_plain_greedy(tiny_lm, real_tokenizer):
    """Draft LM = target, greedy: every draft is accepted and the output equals greedy decoding."""
    prompt = [5, 17, 3]
    with torch.inference_mode():
        ref = tiny_lm.generate(torch.tensor([prompt]), max_new_tokens=20, do_sample=False,
                               eos_token_id=None, pad_token_id=0)[0, 3:].tolist()
    draft, suffix = DraftModelProposer(CachedCausalLM(tiny_lm)), SuffixProposer()
    step = LocalStep({"draft": draft, "ngram": NgramProposer(), "suffix": suffix,
                      "hybrid": HybridProposer(suffix, draft)}, TargetScorer(CachedCausalLM(tiny_lm)))
    for method in ("none", "ngram", "suffix", "hybrid", "draft"):
        gen = Generation(7, prompt, GenerationRequest("x", 20, speculative_method=method), real_tokenizer, [],
                         256, 0)
        run_local(gen, step)
        assert gen.output_ids == ref, method
    assert gen.stats.accepted_tokens == gen.stats.draft_tokens > 0
    assert len(step.scorer.lm) == 0  # run_local released the caches


def test_seeded_sampling_is_reproducible(tiny_lm, real_tokenizer):
    step = LocalStep({"draft": DraftModelProposer(CachedCausalLM(tiny_lm))}, TargetScorer(CachedCausalLM(tiny_lm)))
    outs = []
    for seed in (1, 1, 2):
        req = GenerationRequest("x", 16, temperature=0.8, speculative_method="draft")
        gen = Generation(seed, [1, 2], req, real_tokenizer, [], 256, seed)
        run_local(gen, step)
        outs.append(gen.output_ids)
    assert outs[0] == outs[1] and outs[0] != outs[2]


def test_draft_and_target_apply_the_same_sampling_transforms(tiny_lm, real_tokenizer):
    """Self-draft under temperature, top-k and top-p: the draft's rows are the target's, so every draft is accepted."""
    params = SamplingParams(temperature=0.7, top_k=20, top_p=0.9, seed=3)
    prompt = [5, 17, 3, 9]
    draft = DraftModelProposer(CachedCausalLM(tiny_lm))
    scorer = TargetScorer(CachedCausalLM(tiny_lm))
    proposal = draft.propose_one(1, prompt, 4, params, 0)
    target = scorer.score(1, prompt, proposal.draft_token_ids.tolist(), params)
    assert torch.equal(proposal.draft_probs > 0, target[:4] > 0)  # same top-k/top-p support
    torch.testing.assert_close(proposal.draft_probs, target[:4], atol=1e-5, rtol=1e-4)

    step = LocalStep({"draft": draft}, scorer)
    req = GenerationRequest("x", 24, temperature=0.7, top_k=20, top_p=0.9, random_seed=3, speculative_method="draft")
    gen = Generation(2, prompt, req, real_tokenizer, [], 256, 3)
    run_local(gen, step)
    assert gen.stats.accepted_tokens == gen.stats.draft_tokens > 0
