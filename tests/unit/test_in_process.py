"""spec_decode.in_process: whole generations with the proposer, scorer and verifier objects called in process."""

import torch

from spec_decode.engine.kv_cache import CachedCausalLM
from spec_decode.engine.model_loading import load_causal_lm
from spec_decode.engine.scorer import TargetScorer
from spec_decode.generation import Generation
from spec_decode.in_process import LocalStep, run_local
from spec_decode.proposers import METHODS, DraftModelProposer, build_proposers
from spec_decode.proposers.speculators import aux_hidden_state_layers
from spec_decode.request import GenerationRequest
from spec_decode.sampling import SamplingParams


def test_every_registered_method_equals_plain_greedy(tiny_dir, tiny_lm, tiny_heads_params, real_tokenizer):
    """Every method of the registry, its proposers built from their settings as draft_model builds them (the draft LM
    = the target, hybrid falling back to it, a head of every published layout), greedy: the output equals plain greedy
    decoding; the self-draft's drafts are all accepted, and the heads draft from the target's hidden states."""
    prompt = [5, 17, 3]
    with torch.inference_mode():
        ref = tiny_lm.generate(torch.tensor([prompt]), max_new_tokens=20, do_sample=False,
                               eos_token_id=None, pad_token_id=0)[0, 3:].tolist()
    params = {"draft_model_path": str(tiny_dir), "device": "cpu", "dtype": "float32", "suffix_backend": "python",
              "suffix_max_cached_requests": "16", "hybrid_fallback": "draft", "draft_min_token_prob": "0",
              **tiny_heads_params}
    served = build_proposers(params)
    assert ("none", *served) == METHODS  # every registered proposer is served here
    layers = aux_hidden_state_layers(params["speculator_path"], 2)
    assert layers == [0, 1]  # the EAGLE-3 head's: the target returns their inputs beside its last hidden state
    target = load_causal_lm(tiny_dir, torch.device("cpu"), torch.float32)  # its own copy: the hooks stay on it
    step = LocalStep(served, TargetScorer(CachedCausalLM(target, aux_layers=tuple(layers))))
    stats = {}
    for method in METHODS:
        gen = Generation(7, prompt, GenerationRequest("x", 20, speculative_method=method), real_tokenizer, [],
                         256, 0)
        run_local(gen, step)
        assert gen.output_ids == ref, method
        stats[method] = gen.stats
    # the self-draft's trees branch where it is unsure, but its chains are wholly accepted
    assert stats["draft"].accepted_tokens > 0
    chain = Generation(8, prompt, GenerationRequest("x", 20, speculative_method="draft", draft_tree=False),
                       real_tokenizer, [], 256, 0)
    run_local(chain, step)
    assert chain.output_ids == ref and chain.stats.accepted_tokens == chain.stats.draft_tokens > 0
    for head in ("eagle", "eagle3", "medusa", "mlp_speculator", "arctic"):
        assert stats[head].draft_tokens > 0, head  # hidden states reached it in process too
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
    req = GenerationRequest("x", 24, temperature=0.7, top_k=20, top_p=0.9, random_seed=3, speculative_method="draft",
                            draft_tree=False)  # chains: a tree's other branches are never all accepted
    gen = Generation(2, prompt, req, real_tokenizer, [], 256, 3)
    run_local(gen, step)
    assert gen.stats.accepted_tokens == gen.stats.draft_tokens > 0
