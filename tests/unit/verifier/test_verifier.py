"""spec_decode.verifier.verifier: the rows of a round, checked at construction, verified as if alone."""

import pytest
import torch

from spec_decode.settings import InvalidInputError
from spec_decode.verifier import Verifier, VerifierRow, VerifierSettings


def test_a_row_whose_target_probs_do_not_fit_its_drafts_is_refused_at_construction():
    with pytest.raises(InvalidInputError, match=r"'target_probs': must be \[k\+1, V\] for the k = 2 drafts"):
        VerifierRow(torch.ones(2, 5) / 5, torch.tensor([1, 2]), None, 0, 0, True)
    assert VerifierRow(torch.ones(3, 5) / 5, torch.tensor([1, 2]), None, 0, 0, True).k == 2


def test_the_configured_method_is_the_default_and_a_row_may_name_its_own():
    """typical with epsilon = alpha = 0 accepts any draft of positive probability; rejection at u ~ U[0, 1) not
    always: the verifier's default method applies to rows that name none."""
    gen = torch.Generator().manual_seed(0)
    tp = torch.softmax(torch.randn(5, 7, generator=gen), -1)
    drafts = torch.argmin(tp[:4], -1)  # unlikely drafts
    typical = Verifier(VerifierSettings(acceptance_method="typical", typical_epsilon=0.0, typical_alpha=0.0))
    ids, lps = typical.verify(tp, drafts, None, 3, 0, False)
    assert ids[:4] == drafts.tolist() and len(ids) == 5 and len(lps) == 5
    rows = [VerifierRow(tp, drafts, None, 3 + i, 0, False, "rejection") for i in range(8)]
    assert any(len(ids) < 5 for ids, _ in typical.verify_batch(rows))
    assert lps[0] == pytest.approx(float(torch.log(tp[0, drafts[0]])), rel=1e-6)
