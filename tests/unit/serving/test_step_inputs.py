"""spec_decode.serving.step_inputs: a step row decoded and checked once, each bad value named."""

import numpy as np
import pytest
import torch

from spec_decode.serving import step_inputs as si
from spec_decode.settings import InvalidInputError
from tests.helpers import step_row

METHODS = ("none", "ngram", "suffix")


def _draft_row(k=3, method=b"ngram", **kw):
    return step_row(1, [5, 6, 7, -1, -1], num_draft_tokens=np.array([k], np.int32),
                    speculative_method=np.array([method], object), **kw)


def test_values_are_read_from_numpy_and_torch_rows_and_padding_is_stripped():
    row = _draft_row(step=np.array([4], np.int64))
    assert si.sequence_id(row) == 1 and si.token_ids(row) == [5, 6, 7] and not si.is_release(row)
    assert si.scalar({"step": torch.tensor([9])}, "step") == 9  # a GPU input arrives as a torch tensor
    assert si.text({"acceptance_method": np.array([b"typical"], object)}, "acceptance_method") == "typical"
    with pytest.raises(InvalidInputError, match="'sequence_id': required"):
        si.sequence_id({})
    with pytest.raises(InvalidInputError, match="'token_ids': must not be empty"):
        si.token_ids({"token_ids": np.array([-1, -1], np.int64)})


def test_sampling_parameters_and_the_acceptance_method_follow_the_shared_rules():
    p = si.sampling_params(step_row(1, [1], temperature=np.array([0.7], np.float32), top_k=np.array([5], np.int32),
                                    random_seed=np.array([11], np.int64), seeded=np.array([False])))
    assert (p.temperature, p.top_k, p.seed, p.seeded) == (pytest.approx(0.7), 5, 11, False)
    for name, bad in (("temperature", np.array([-0.5], np.float32)), ("top_p", np.array([0.0], np.float32)),
                      ("top_k", np.array([-1], np.int32))):
        with pytest.raises(InvalidInputError, match=f"'{name}'"):
            si.sampling_params(step_row(1, [1], **{name: bad}))
    assert si.acceptance_method({}) == ""
    assert si.acceptance_method({"acceptance_method": np.array([b" "], object)}) == ""
    assert si.acceptance_method({"acceptance_method": np.array([b"Typical"], object)}) == "typical"
    with pytest.raises(InvalidInputError, match="'acceptance_method': 'maybe' is not one of rejection, typical"):
        si.acceptance_method({"acceptance_method": np.array([b"maybe"], object)})


def test_a_draft_row_becomes_a_proposal_request_or_asks_for_nothing():
    method, req = si.proposal_request(_draft_row(step=np.array([2], np.int64)), METHODS, max_k=8)
    assert method == "ngram" and (req.seq_id, req.token_ids, req.k, req.step) == (1, [5, 6, 7], 3, 2)
    assert si.proposal_request(_draft_row(k=0), METHODS, 8) == ("ngram", None)
    assert si.proposal_request(_draft_row(method=b"none"), METHODS, 8) == ("none", None)
    with pytest.raises(InvalidInputError, match=r"'num_draft_tokens': must be in \[0, 8\], got 9"):
        si.proposal_request(_draft_row(k=9), METHODS, 8)
    with pytest.raises(InvalidInputError, match="'speculative_method': 'draft' is not one of none, ngram, suffix"):
        si.proposal_request(_draft_row(method=b"draft"), METHODS, 8)  # not served here: no draft LM


def test_token_ids_must_fit_int32_and_drafts_stop_at_the_first_one_outside_the_vocabulary():
    for bad in ([5, -3], [5, 2**31], [2**63 - 1]):
        with pytest.raises(InvalidInputError, match=r"'token_ids': token ids must lie in \[0, 2\^31\)"):
            si.token_ids({"token_ids": np.array(bad, np.int64)})
    row = {"draft_token_ids": np.array([3, 9, 500, 4, -1, -1], np.int64)}
    assert si.draft_token_ids(row, vocab_size=97) == [3, 9]  # 500 is no token of this vocabulary: the drafts end
    assert si.draft_token_ids(row, vocab_size=1000) == [3, 9, 500, 4]
    assert si.draft_token_ids({}, 97) == []
    with pytest.raises(InvalidInputError, match="'speculative_method': not valid UTF-8"):
        si.text({"speculative_method": np.array([b"\xff"], object)}, "speculative_method")
