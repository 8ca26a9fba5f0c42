"""Structured output under speculation, in process: with a regex guide, sampled output keeps the processed target
law exactly (chi-square over the four strings ``[ab]{2}`` allows, each the sum over its token paths), for a draft LM
that applies the grammar to its own distribution and for a proposer whose drafts ignore it; greedy output equals
``none``'s and always matches the guide."""

import re

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from spec_decode.engine.kv_cache import CachedCausalLM
from spec_decode.engine.scorer import TargetScorer
from spec_decode.generation import Generation
from spec_decode.in_process import LocalStep, run_local
from spec_decode.processors import ProcessorSpec, process_logits
from spec_decode.processors.grammar import GrammarCache
from spec_decode.proposers import DraftModelProposer, Proposal, Proposer
from spec_decode.request import GenerationRequest
from spec_decode.sampling import generator_for

GUIDE = "[ab]{2}"
PROMPT = [81, 82, 369, 81]  # "a", "b", "ab", "a"
SUPPORT = (81, 82, 11510, 369, 8094, 15659, 83, 2)  # a, b, aa, ab, ba, bb, c (never allowed), EOS


class SupportProposer(Proposer):
    """Drafts from q = uniform over SUPPORT, whatever the grammar allows (so the target rejects some drafts)."""

    name = "support"

    def propose(self, requests):
        out = []
        for r in requests:
            g = generator_for(r.params.seed, r.step, 98)
            drafts = torch.tensor([SUPPORT[int(i)] for i in torch.randint(len(SUPPORT), (r.k,), generator=g)])
            q = torch.zeros(r.k, 49152)
            q[:, list(SUPPORT)] = 1 / len(SUPPORT)
            out.append(Proposal(drafts, q))
        return out


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py


@pytest.fixture(scope="module")
def lm():
    """A tiny random Llama over the real tokenizer's 49,152 ids, its head scaled so its distributions are peaked."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(3)
    cfg = LlamaConfig(vocab_size=49152, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=256,
                      tie_word_embeddings=False)
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        model.lm_head.weight[list(SUPPORT)] *= 30
    return model


@pytest.fixture(scope="module")
def step(lm, real_tokenizer):
    grammar = GrammarCache(real_tokenizer, 49152)
    draft = DraftModelProposer(CachedCausalLM(lm))
    draft.grammar = GrammarCache(real_tokenizer, 49152)  # draft_model's own matchers
    return LocalStep({"self": draft, "support": SupportProposer()},
                     TargetScorer(CachedCausalLM(lm), grammar=grammar))


SPEC = ProcessorSpec(len(PROMPT), stop_ids=(2,), guide_type="regex", guide=GUIDE)


def _run(step, tok, method, seq, **kw):
    req = GenerationRequest("x", 8, speculative_method=method, num_draft_tokens=3, **kw)
    gen = Generation(seq, PROMPT, req, tok, [2], 256, kw.get("random_seed", 0))
    gen.processors = SPEC
    run_local(gen, step)
    return gen


def _law(lm, tok) -> dict[str, float]:
    """The exact law of the output text under the processed target, summed over token paths (one position at a time,
    with a grammar of its own)."""
    ref = GrammarCache(tok, 49152)
    law: dict[str, float] = {}

    def walk(out: list[int], p: float, depth: int):
        with torch.inference_mode():
            logits = lm(torch.tensor([PROMPT + out])).logits[0, -1:]
        probs = torch.softmax(process_logits(logits, SPEC, PROMPT + out, (), ref, 10_000 + depth)[0].double(), -1)
        for t in torch.nonzero(probs > 0)[:, 0].tolist():
            if t == 2:
                text = tok.decode(out)
                law[text] = law.get(text, 0.0) + p * float(probs[t])
            else:
                walk(out + [t], p * float(probs[t]), depth + 1)

    walk([], 1.0, 0)
    return law


@pytest.mark.parametrize("method", ["self", "support"])
def test_greedy_output_matches_the_guide_and_equals_none_s(step, real_tokenizer, method):
    plain = _run(step, real_tokenizer, "none", 1)
    gen = _run(step, real_tokenizer, method, 2)
    assert gen.output_ids == plain.output_ids and re.fullmatch(GUIDE, gen.text) and gen.finish_reason == "stop"


@pytest.mark.parametrize("method", ["self", "support"])
def test_sampled_output_keeps_the_processed_target_law(step, lm, real_tokenizer, method):
    law = _law(lm, real_tokenizer)
    assert set(law) == {"aa", "ab", "ba", "bb"} and sum(law.values()) == pytest.approx(1.0)
    n = 500
    texts = [_run(step, real_tokenizer, method, 100 + s, temperature=1.0, random_seed=s).text for s in range(n)]
    assert set(texts) <= set(law)
    keys = sorted(law)
    observed = np.array([texts.count(k) for k in keys])
    expected = np.array([law[k] for k in keys]) * n
    assert chisquare(observed, expected).pvalue > 1e-3, (observed, expected)
