"""spec_decode.sampling: the sampling transforms shared by the draft and the target, and the sampling rules."""

import pytest
import torch

from spec_decode.sampling import SamplingParams, logits_to_probs
from spec_decode.settings import InvalidInputError


def test_top_k_top_p_transforms():
    logits = torch.tensor([[3.0, 2.0, 1.0, 0.0]])
    pk = logits_to_probs(logits, SamplingParams(temperature=1.0, top_k=2))
    assert (pk[0, 2:] == 0).all() and abs(float(pk.sum()) - 1) < 1e-6
    pp = logits_to_probs(logits, SamplingParams(temperature=1.0, top_p=0.5))
    assert (pp[0, 1:] == 0).all()  # the top token has ~64% of the mass


def test_tiny_temperature_is_the_argmax_limit_not_nan():
    logits = torch.tensor([[1.0, 3.0, 2.5, -1e4], [0.0, 0.0, -5.0, 7.0]])
    for t in (1e-37, 1e-45, 1e-3):
        probs = logits_to_probs(logits, SamplingParams(temperature=t, top_k=3))
        assert torch.isfinite(probs).all()
        torch.testing.assert_close(probs, torch.tensor([[0.0, 1.0, 0.0, 0.0], [0.0, 0.0, 0.0, 1.0]]))
    torch.testing.assert_close(logits_to_probs(logits, SamplingParams(temperature=0.7)),
                               torch.softmax(logits / 0.7, -1))


@pytest.mark.parametrize("kwargs, field", [
    ({"temperature": -1.0}, "temperature"), ({"temperature": 101.0}, "temperature"),
    ({"temperature": float("nan")}, "temperature"), ({"temperature": float("inf")}, "temperature"),
    ({"top_k": -1}, "top_k"), ({"top_p": 0.0}, "top_p"), ({"top_p": 1.5}, "top_p"),
    ({"top_p": float("nan")}, "top_p"),
])
def test_sampling_parameters_out_of_range_are_named(kwargs, field):
    """The one place of the sampling rules: generate's requests and the step models' rows both come through here."""
    with pytest.raises(InvalidInputError, match=f"'{field}'") as e:
        SamplingParams(**kwargs)
    assert e.value.field == field
    SamplingParams(temperature=100.0, top_k=0, top_p=1.0)  # the bounds themselves are allowed
