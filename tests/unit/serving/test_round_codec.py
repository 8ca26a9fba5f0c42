"""The round codec (spec_decode.serving.round_codec) and the one StepResult builder (spec_decode.protocol.step_result):
padded rows decode to each step's own ids, a tree row's hidden states are those of its accepted path's rows, the
parents padding (-1, the root itself) is never read as parents, and the per-depth metrics count what a tree reached."""

from dataclasses import replace

import numpy as np
import pytest

from spec_decode.protocol import StepInputs, step_result
from spec_decode.sampling import SamplingParams
from spec_decode.serving.metrics import Metrics
from spec_decode.serving.round_codec import decode_results, encode_round, row_parents

# row 0: a tree of 4 nodes (two root-level branches); row 1: a chain of 2; row 2: no drafts (plain decoding)
TREE, TREE_PARENTS = [5, 6, 7, 8], [-1, -1, 1, 2]
CHAIN = [3, 4]


def _steps() -> list[StepInputs]:
    return [StepInputs(1, [9, 9, 9], 4, "suffix", SamplingParams(), 0, draft_tree=True),
            StepInputs(2, [1, 2], 2, "ngram", SamplingParams(), 0, draft_tree=True),
            StepInputs(3, [4], 0, "none", SamplingParams(), 0)]


def _outputs() -> dict:
    hidden = np.zeros((3, 5, 2), np.float32)
    hidden[:, :, 0] = np.arange(5)  # column 0 of row j holds j: the tests read which rows were kept
    return {
        "output_ids": np.array([[6, 7, 8, 11], [3, 12, -1, -1], [13, -1, -1, -1]]),
        "output_log_probs": np.array([[-0.1, -0.2, -0.3, -0.4], [-0.5, -0.6, 0, 0], [-0.7, 0, 0, 0]], np.float32),
        "draft_token_ids": np.array([TREE, CHAIN + [-1, -1], [-1] * 4]),
        "draft_parents": np.array([TREE_PARENTS, [-1, 0, -1, -1], [-1] * 4], np.int32),
        "hidden_states": hidden,
        "num_cached_tokens": np.array([[2], [1], [0]], np.int32),
        "target_forward_seconds": np.array([[0.5], [0.5], [0.5]], np.float32),
    }


def test_decoded_results_take_each_rows_own_ids_and_its_accepted_paths_hidden_rows():
    tree_res, chain_res, plain_res = decode_results(_steps(), _outputs())
    assert tree_res.output_ids == [6, 7, 8, 11] and tree_res.num_draft_tokens == 4
    assert tree_res.draft_depth == 3  # nodes 1 -> 2 -> 3
    assert tree_res.hidden_states[:, 0].tolist() == [0, 2, 3, 4]  # row 0, then the path's nodes 1, 2, 3 (+ 1)
    assert tree_res.log_probs == pytest.approx([-0.1, -0.2, -0.3, -0.4])
    assert (tree_res.cached_tokens, tree_res.forward_seconds) == (2, 0.5)
    assert chain_res.output_ids == [3, 12] and chain_res.draft_depth == 2
    assert chain_res.hidden_states[:, 0].tolist() == [0, 1]
    assert plain_res.output_ids == [13] and plain_res.num_draft_tokens == 0 and plain_res.hidden_states.shape == (1, 2)


def test_parents_padding_is_never_read_as_parents():
    """-1 pads draft_parents but is also the root: a row's parents are its first k entries, not the row stripped."""
    assert row_parents(np.array([-1, -1, -1, -1], np.int32), 2) == [-1, -1]  # two root-level siblings
    assert row_parents(np.array([-1, 0, -1, -1], np.int32), 2) is None  # a chain
    assert row_parents(np.array([], np.int32), 0) is None


def test_emitted_ids_that_do_not_follow_the_drafts_are_an_error():
    with pytest.raises(ValueError, match="path"):
        step_result(_steps()[0], [7, 7, 1], [0.0] * 3, TREE, TREE_PARENTS)


def test_encoded_rounds_carry_draft_tree_only_when_a_drafting_row_may_branch():
    steps = _steps()
    assert encode_round(steps, False)["draft_tree"].reshape(-1).tolist() == [True, True, False]
    chains = [StepInputs(1, [9], 2, "suffix", SamplingParams(), 0)]
    assert "draft_tree" not in encode_round(chains, False)
    assert "tree_top_k" not in encode_round(steps, False)  # no row set a shape: draft_model's config
    shaped = encode_round([replace(steps[0], tree_top_k=3), steps[1]], False)
    assert shaped["tree_top_k"].tolist() == [[3], [0]] and shaped["tree_top_k"].dtype == np.int32
    assert "tree_depth" not in shaped


def test_the_depth_counters_count_what_a_tree_reached():
    m = Metrics()
    m.record_depths("suffix", 4, 3, 2)  # a tree: 4 nodes, depth 3, 2 accepted
    m.record_depths("suffix", 2, None, 2)  # a chain of 2, both accepted
    assert m.get("spec_decode_tree_steps_total", method="suffix") == 1
    drafted = [m.get("spec_decode_drafted_depth_total", method="suffix", depth=str(d)) for d in (1, 2, 3, 4)]
    accepted = [m.get("spec_decode_accepted_depth_total", method="suffix", depth=str(d)) for d in (1, 2, 3, 4)]
    assert drafted == [2, 2, 1, 0] and accepted == [2, 2, 0, 0]


def test_a_rounds_drafts_decode_flat_with_every_parent_spelled_out():
    from spec_decode.serving.round_codec import RoundDrafts

    out = _outputs()
    meta = RoundDrafts.decode(3, out["draft_token_ids"], out["draft_parents"])
    assert meta.num_draft_tokens.tolist() == [4, 2, 0]
    assert meta.draft_token_ids.tolist() == TREE + CHAIN
    assert meta.parents.tolist() == TREE_PARENTS + [-1, 0]
    assert meta.row(0) == (TREE, TREE_PARENTS) and meta.row(1) == (CHAIN, None) and meta.row(2) == ([], None)
    assert RoundDrafts.decode(2, None, None).row(1) == ([], None)
