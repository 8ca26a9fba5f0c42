"""spec_decode.proposers.draft_lm: a round's drafts as each sequence's alone, and the confidence rule that ends a
step's drafts (draft_min_token_prob)."""

import pytest
import torch

from spec_decode.engine.kv_cache import CachedCausalLM
from spec_decode.proposers import DraftLMSettings, DraftModelProposer, ProposalRequest
from spec_decode.sampling import SamplingParams
from tests.helpers import assert_cut_by_rule, confidence_rule


def _requests():
    g = torch.Generator().manual_seed(3)
    return [ProposalRequest(s, torch.randint(0, 97, (4 + s,), generator=g).tolist(), 4,
                            SamplingParams() if s % 2 else SamplingParams(temperature=1.0, seed=s), 0)
            for s in range(40)]


def test_a_step_drafts_while_its_confidence_holds_and_scores_its_drafts(tiny_lm):
    """With min_token_prob = t, each proposal is the prefix of the every-slot proposal up to the first slot i where
    (product of the drafts' probabilities before i) x (slot i's top probability) < t; its score is the sum of its
    drafts' running probabilities."""
    lm = CachedCausalLM(tiny_lm)
    every = DraftModelProposer(lm, None, 0.0).propose(_requests())
    for r in _requests():
        lm.release(r.seq_id)
    assert all(len(p.draft_token_ids) == 4 for p in every)
    running, confidence = confidence_rule(every)
    t = float(torch.stack([c[1] for c in confidence]).median())  # about half the rows stop after one draft
    cut = DraftModelProposer(lm, None, t).propose(_requests())
    lengths = assert_cut_by_rule(every, cut, running, confidence, t, atol=1e-5, rtol=1e-4)
    assert len(set(lengths)) > 1  # the rule cut some rows, not all
    with pytest.raises(Exception, match="draft_min_token_prob"):
        DraftLMSettings(draft_min_token_prob=-0.1)
