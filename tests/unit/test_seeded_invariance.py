"""A seeded sampled request's output does not depend on how its steps fell (Daliri et al. 2024, "Drafter-invariant
speculative decoding"): in process with the tiny random models, every method, k in {1, 4}, and speculation turned
off every other step (as disable_by_batch_size does under load) give the same tokens as plain sampling."""

from dataclasses import replace

import pytest
import torch

from spec_decode.engine.kv_cache import CachedCausalLM
from spec_decode.engine.model_loading import load_causal_lm
from spec_decode.engine.scorer import TargetScorer
from spec_decode.generation import Generation
from spec_decode.in_process import LocalStep, run_local
from spec_decode.proposers import METHODS, build_proposers
from spec_decode.proposers.speculators import aux_hidden_state_layers
from spec_decode.protocol import StepInputs, StepResult
from spec_decode.request import GenerationRequest


class _EveryOtherStepUndrafted:
    """A step callable that turns speculation off (k = 0) at every odd step, as disable_by_batch_size does under
    load."""

    def __init__(self, step: LocalStep):
        self.step = step

    def __call__(self, inp: StepInputs) -> StepResult:
        return self.step(replace(inp, num_draft_tokens=0) if inp.step % 2 else inp)

    def release(self, seq_id: int, final_token_ids=None) -> None:
        self.step.release(seq_id, final_token_ids)


@pytest.fixture(scope="module")
def local_step(tiny_dir, tiny_heads_params):
    params = {"draft_model_path": str(tiny_dir), "device": "cpu", "dtype": "float32", "suffix_backend": "python",
              "suffix_max_cached_requests": "16", "hybrid_fallback": "draft", "draft_min_token_prob": "0",
              **tiny_heads_params}
    served = build_proposers(params)
    assert ("none", *served) == METHODS  # every method drafts here, the heads of every published layout too
    target = load_causal_lm(tiny_dir, torch.device("cpu"), torch.float32)  # returns the EAGLE-3 head's layers too
    lm = CachedCausalLM(target, aux_layers=tuple(aux_hidden_state_layers(params["speculator_path"], 2)))
    return LocalStep(served, TargetScorer(lm))


_SEQ = iter(range(1, 10**6))  # a fresh sequence id per generation: no cache is shared between them


def _generate(step, tokenizer, method, k, seed, prompt, temperature=0.9, top_k=0, top_p=1.0, acceptance=""):
    req = GenerationRequest("x", 20, temperature=temperature, top_k=top_k, top_p=top_p, random_seed=seed,
                            speculative_method=method, num_draft_tokens=k, ignore_eos=True,
                            acceptance_method=acceptance)
    gen = Generation(next(_SEQ), list(prompt), req, tokenizer, [], 256, seed)
    run_local(gen, step)
    return gen


@pytest.mark.parametrize("seed, sampling", [(11, {}), (12, {"top_k": 20, "top_p": 0.9, "temperature": 0.7})])
def test_a_seeded_request_gives_the_same_tokens_whatever_the_method_k_or_load(local_step, real_tokenizer, seed,
                                                                              sampling):
    prompt, tok = [5, 17, 3, 9], real_tokenizer
    ref = _generate(local_step, tok, "none", 1, seed, prompt, **sampling).output_ids
    assert len(ref) == 20
    for method in METHODS:
        for k in (1, 4):
            for step in (local_step, _EveryOtherStepUndrafted(local_step)):
                gen = _generate(step, tok, method, k, seed, prompt, **sampling)
                assert gen.output_ids == ref, (method, k, type(step).__name__)
                if method == "draft" and step is local_step:  # the self-draft races the target's own noise
                    assert gen.stats.accepted_tokens >= 0.9 * gen.stats.draft_tokens > 0, gen.stats
    # another seed gives other tokens; an explicit rejection method is the default's
    assert _generate(local_step, tok, "none", 1, seed + 1, prompt, **sampling).output_ids != ref
    assert _generate(local_step, tok, "ngram", 4, seed, prompt, acceptance="rejection", **sampling).output_ids == ref


def test_unseeded_requests_keep_rejection_sampling(local_step, real_tokenizer):
    """An unseeded sampled request is not coupled: the self-draft's drafts come with its probabilities and rejection
    sampling accepts (almost) all of them, and the output still depends on the seed generate drew."""
    prompt = [5, 17, 3, 9]
    req = GenerationRequest("x", 20, temperature=0.9, speculative_method="draft", num_draft_tokens=4, ignore_eos=True)
    gen = Generation(next(_SEQ), prompt, req, real_tokenizer, [], 256, 77)
    assert not gen.params.seeded
    run_local(gen, local_step)
    assert gen.stats.accepted_tokens >= 0.9 * gen.stats.draft_tokens > 0


def test_the_step_counter_does_not_key_a_coupled_row():
    """A coupled row's token is keyed by its seed and position, not by the step counter."""
    from spec_decode.verifier import Verifier

    p = torch.softmax(torch.randn(1, 13, generator=torch.Generator().manual_seed(0)), -1)
    ver = Verifier()
    a = ver.verify(p, torch.empty(0, dtype=torch.int64), None, 5, 0, False, "", 7, True)
    b = ver.verify(p, torch.empty(0, dtype=torch.int64), None, 5, 99, False, "", 7, True)
    assert a == b  # the step counter does not key a coupled row
