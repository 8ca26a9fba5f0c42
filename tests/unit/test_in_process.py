"""spec_decode.in_process: whole generations with the proposer, scorer and verifier objects called in process."""

import torch

from spec_decode.engine.kv_cache import CachedCausalLM
from spec_decode.engine.scorer import TargetScorer
from spec_decode.generation import Generation
from spec_decode.in_process import LocalStep, run_local
from spec_decode.proposers import METHODS, DraftModelProposer, build_proposers
from spec_decode.request import GenerationRequest
from spec_decode.sampling import SamplingParams
from tests.helpers import save_tiny_eagle


def test_every_registered_method_equals_plain_greedy(tiny_dir, tiny_lm, real_tokenizer, tmp_path):
    """Every method of the registry, its proposers built from their settings as draft_model builds them (the draft LM
    = the target, hybrid falling back to it), greedy: the output equals plain greedy decoding; the self-draft's drafts
    are all accepted."""
    prompt = [5, 17, 3]
    with torch.inference_mode():
        ref = tiny_lm.generate(torch.tensor([prompt]), max_new_tokens=20, do_sample=False,
                               eos_token_id=None, pad_token_id=0)[0, 3:].tolist()
    served = build_proposers({"draft_model_path": str(tiny_dir), "device": "cpu", "dtype": "float32",
                              "suffix_backend": "python", "suffix_max_cached_requests": "16",
                              "hybrid_fallback": "draft", "draft_min_token_prob": "0",
                              "eagle_path": str(save_tiny_eagle(tiny_lm, tmp_path / "eagle")),
                              "eagle_min_token_prob": "0"})
    assert ("none", *served) == METHODS  # every registered proposer is served here
    step = LocalStep(served, TargetScorer(CachedCausalLM(tiny_lm)))
    stats = {}
    for method in METHODS:
        gen = Generation(7, prompt, GenerationRequest("x", 20, speculative_method=method), real_tokenizer, [],
                         256, 0)
        run_local(gen, step)
        assert gen.output_ids == ref, method
        stats[method] = gen.stats
    assert stats["draft"].accepted_tokens == stats["draft"].draft_tokens > 0
    assert stats["eagle"].draft_tokens > 0  # hidden states reached it in process too
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
