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


def test_log_prob_rows_follow_the_mode_and_prompt_log_probs_come_on_the_first_step(tiny_lm):
    from spec_decode.processors import ProcessorSpec

    ids, drafts = [1, 2, 3, 4], [5, 6]
    spec = ProcessorSpec(4, repetition_penalty=1.5, logprobs=True, prompt_logprobs=2)
    params = SamplingParams(0.7, 0, 1.0)
    full = _full_logits(tiny_lm, ids + drafts)
    raw = TargetScorer(CachedCausalLM(tiny_lm)).score_batch([(1, ids, drafts, params, spec)])[0]
    torch.testing.assert_close(raw.log_probs, torch.log_softmax(full[-3:], -1), atol=1e-5, rtol=1e-4)
    assert raw.prompt is not None and len(raw.prompt.log_probs) == 3 and all(len(t) == 2 for t in raw.prompt.top_ids)
    want = torch.log_softmax(full[:3], -1).gather(1, torch.tensor(ids[1:])[:, None])[:, 0]
    torch.testing.assert_close(torch.tensor(raw.prompt.log_probs), want, atol=1e-5, rtol=1e-4)
    later = TargetScorer(CachedCausalLM(tiny_lm)).score_batch([(1, ids + [7], drafts, params, spec)])[0]
    assert later.prompt is None  # not the first step
    processed = TargetScorer(CachedCausalLM(tiny_lm), "processed").score_batch([(1, ids, drafts, params, spec)])[0]
    assert processed.log_probs is None  # the verifier takes log(target_probs)
    assert not torch.allclose(processed.probs, torch.softmax(full[-3:] / 0.7, -1))  # the penalty was applied
