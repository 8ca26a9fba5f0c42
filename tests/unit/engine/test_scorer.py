"""spec_decode.engine.scorer: k+1 target distributions per step, alone and batched."""

import torch

from spec_decode.engine.kv_cache import CachedCausalLM
from spec_decode.engine.scorer import TargetScorer
from spec_decode.sampling import SamplingParams

GREEDY = SamplingParams()


def _full_logits(model, ids):
    with torch.inference_mode():
        return model(input_ids=torch.tensor([ids])).logits[0]


def test_scorer_returns_k_plus_one_distributions(tiny_lm):
    scorer = TargetScorer(CachedCausalLM(tiny_lm))
    probs = scorer.score(1, [1, 2, 3], [4, 5], GREEDY)
    assert probs.shape == (3, 97)
    torch.testing.assert_close(probs.sum(-1), torch.ones(3))
    torch.testing.assert_close(probs, torch.softmax(_full_logits(tiny_lm, [1, 2, 3, 4, 5])[-3:], -1),
                               atol=1e-5, rtol=1e-4)
