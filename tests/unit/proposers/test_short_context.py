"""A proposer whose model cannot take a sequence's next positions drafts nothing for that sequence (and fewer for one
near the bound) instead of failing its step; the other sequences of the round draft as before."""

from dataclasses import replace

import pytest
import torch

from spec_decode.engine.kv_cache import CachedCausalLM
from spec_decode.engine.scorer import TargetScorer
from spec_decode.generation import Generation
from spec_decode.in_process import LocalStep, run_local
from spec_decode.proposers import DraftModelProposer, Eagle3Proposer, EagleProposer, ProposalRequest
from spec_decode.proposers.eagle import load_eagle1, load_eagle3
from spec_decode.proposers.speculators import TargetInfo
from spec_decode.request import GenerationRequest
from spec_decode.sampling import SamplingParams

SHORT = 32  # the draft models' max_position_embeddings here (the target's tiny_lm takes 1,024)


@pytest.fixture(scope="module")
def short_lm():
    """A tiny random Llama over the target's vocabulary with 32 positions."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(1)
    cfg = LlamaConfig(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=SHORT)
    return LlamaForCausalLM(cfg).eval()


def _ids(n, start=0):
    return [(start + 7 * i) % 97 for i in range(n)]


def test_the_draft_lm_caps_each_sequence_s_k_at_its_free_positions(short_lm):
    p = DraftModelProposer(CachedCausalLM(short_lm), None, 0.0)
    long, near, short = (ProposalRequest(1, _ids(40), 4, SamplingParams(), 0),
                         ProposalRequest(2, _ids(SHORT - 2, 3), 4, SamplingParams(), 0),
                         ProposalRequest(3, _ids(10, 5), 4, SamplingParams(temperature=0.8, seed=4), 0))
    for r in (long, near, short):
        p.check(r)  # length alone is not refused
    got = p.propose([long, near, short])
    assert [len(x.draft_token_ids) for x in got] == [0, 2, 4]
    assert got[0].draft_probs is None and got[2].draft_probs.shape == (4, 97)
    alone = p.propose([short])[0]  # the short sequence drafts what it drafts without the long one
    assert alone.draft_token_ids.tolist() == got[2].draft_token_ids.tolist()
    assert p.propose([ProposalRequest(4, _ids(SHORT), 4, SamplingParams(), 0)])[0].draft_token_ids.numel() == 0
    with pytest.raises(ValueError, match="token_ids"):  # ids outside the vocabulary are still refused
        p.check(ProposalRequest(5, [1, 2, 97], 4, SamplingParams(), 0))


def test_a_generation_past_the_draft_s_positions_keeps_the_target_s_greedy_output(short_lm, tiny_lm, real_tokenizer):
    prompt = _ids(20, 1)
    with torch.inference_mode():
        ref = tiny_lm.generate(torch.tensor([prompt]), max_new_tokens=30, do_sample=False, eos_token_id=None,
                               pad_token_id=0)[0, len(prompt):].tolist()
    step = LocalStep({"draft": DraftModelProposer(CachedCausalLM(short_lm), None, 0.0)},
                     TargetScorer(CachedCausalLM(tiny_lm)))
    gen = Generation(9, prompt, GenerationRequest("x", 30, speculative_method="draft", num_draft_tokens=4,
                                                  ignore_eos=True), real_tokenizer, [], 256, 0)
    run_local(gen, step)
    assert gen.output_ids == ref
    assert gen.stats.draft_tokens > 0 and len(gen.token_ids) > SHORT  # it drafted early, and grew past the bound


@pytest.mark.parametrize("method", ["eagle", "eagle3"])
def test_an_eagle_head_caps_k_at_the_target_s_positions(tiny_heads, tiny_lm, method):
    """An EAGLE head drafts for a target of SHORT positions (its bound is the target's, recorded at load)."""
    target = replace(TargetInfo.from_model(tiny_lm), max_position_embeddings=SHORT)
    if method == "eagle":
        model, vocab = load_eagle1(tiny_heads["eagle"], target)
    else:
        model, vocab = load_eagle3(tiny_heads["eagle3"], target)
    assert model.max_positions == SHORT
    p = (EagleProposer if method == "eagle" else Eagle3Proposer)(model, vocab, 0.0)
    g = torch.Generator().manual_seed(2)
    width = 32 if method == "eagle" else 96  # EAGLE-3 reads the inputs of the target's layers 0 and 1 too
    reqs = [ProposalRequest(1, _ids(40), 4, SamplingParams(), 0, torch.randn(3, width, generator=g)),
            ProposalRequest(2, _ids(SHORT - 1, 3), 4, SamplingParams(), 0, torch.randn(3, width, generator=g)),
            ProposalRequest(3, _ids(10, 5), 4, SamplingParams(), 0, torch.randn(3, width, generator=g))]
    for r in reqs:
        p.check(r)  # length alone is not refused
    got = p.propose(reqs)
    assert [len(x.draft_token_ids) for x in got] == [0, 1, 4]
    assert p.room(reqs[0]) == 0 and p.room(reqs[1]) == 1 and p.room(reqs[2]) == 4
