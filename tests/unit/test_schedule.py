"""spec_decode.scheduler.k_schedule: k from step to step, and vLLM's disable_by_batch_size."""

import pytest

from spec_decode.scheduler.k_schedule import ConstantK, HeuristicK, make_schedule, speculation_disabled


def test_heuristic_grows_after_full_acceptance_shrinks_after_a_rejection_and_ignores_short_proposals():
    s = HeuristicK(8)
    assert s.update(4, 4, 4) == 6 and s.update(7, 7, 7) == 8 and s.update(8, 8, 8) == 8  # +2, bounded
    assert s.update(4, 4, 3) == 3 and s.update(1, 1, 0) == 1  # -1, at least 1
    assert s.update(4, 2, 2) == 4  # the proposer found fewer than k: k stays
    assert s.update(0, 0, 0) == 0  # speculation off (none, or disabled): k stays
    with pytest.raises(ValueError, match="max_k"):
        HeuristicK(0)


def test_constant_keeps_k_and_names_are_checked():
    assert ConstantK().update(4, 4, 4) == 4 and ConstantK().update(4, 4, 0) == 4
    assert isinstance(make_schedule("constant", 8), ConstantK)
    assert isinstance(make_schedule("heuristic", 8), HeuristicK) and make_schedule("heuristic", 8).max_k == 8
    with pytest.raises(ValueError, match="allowed values are constant, heuristic"):
        make_schedule("fast", 8)


def test_disable_by_batch_size():
    assert not speculation_disabled(running=7, disable_by_batch_size=8)
    assert speculation_disabled(running=8, disable_by_batch_size=8)
    assert not speculation_disabled(running=100, disable_by_batch_size=0)
