"""spec_decode.serving.draft_model: rows go to their method's proposer, one propose call per method per execute();
a bad row or a failing proposer fails only its rows; releases reach every proposer."""

import numpy as np
import pytest
import torch

from spec_decode.proposers import Proposal
from spec_decode.serving.draft_model import DraftBackend
from tests.helpers import step_row


def _row(seq, ids, method, k=3, **kw):
    return step_row(seq, ids, num_draft_tokens=np.array([k], np.int32),
                    speculative_method=np.array([method.encode()], object), **kw)


@pytest.fixture(scope="module")
def draft(tiny_dir):
    return DraftBackend({"draft_model_path": str(tiny_dir), "device": "cpu", "dtype": "float32",
                         "suffix_backend": "python", "draft_min_token_prob": "0"})


def test_draft_lm_rows_share_forwards_and_a_bad_row_fails_alone(draft, tiny_lm):
    out = draft.run_batch([_row(1, [5, 6, 7], "draft"), _row(2, [1, 2], "draft"), _row(5, [1, 2], "draft", k=99)])
    for o, ids in zip(out[:2], ([5, 6, 7], [1, 2])):
        with torch.inference_mode():
            full = tiny_lm.generate(torch.tensor([ids]), max_new_tokens=3, do_sample=False, eos_token_id=None,
                                    pad_token_id=0)[0, len(ids):].tolist()
        # greedy rows: no [k, V] probabilities (the verifier's argmax walk never reads them)
        assert o["draft_token_ids"].tolist() == full and o["draft_probs"].shape == (0, 0)
    assert isinstance(out[2], ValueError) and "num_draft_tokens" in str(out[2]) and "[0, 16]" in str(out[2])
    (sampled,) = draft.run_batch([_row(3, [5, 6, 7], "draft", temperature=np.array([0.8], np.float32),
                                       random_seed=np.array([1], np.int64))])
    assert sampled["draft_probs"].shape == (3, 97)  # a sampled row's rejection sampling reads them
    draft.run_batch([_row(i, [5], "draft", release=True) for i in (1, 2, 3)])
    assert draft.metrics.get("spec_decode_draft_kv_cache_sequences") == 0


def test_each_method_gets_one_call_and_a_failing_proposer_fails_only_its_rows(draft, monkeypatch):
    calls = []
    for name, p in draft.proposers.items():
        monkeypatch.setattr(p, "propose", lambda rs, _name=name, _real=p.propose: calls.append(
            (_name, [r.seq_id for r in rs])) or _real(rs))
    monkeypatch.setattr(draft.proposers["suffix"], "propose", lambda rs: (_ for _ in ()).throw(RuntimeError("boom")))
    rows = [_row(1, [4, 9, 3, 4], "ngram"), _row(2, [1, 2, 3], "suffix"), _row(3, [5, 6, 5], "ngram"),
            _row(4, [1, 2], "none"), _row(5, [1, 2], "ngram", k=0), _row(6, [1, 2], "magic"),
            _row(7, [1, 10**6], "draft")]
    out = draft.run_batch(rows)
    assert calls == [("ngram", [1, 3])]  # one call for both ngram rows; none, k = 0 and the bad rows propose nothing
    assert out[0]["draft_token_ids"].tolist() == [9, 3, 4] and out[2]["draft_token_ids"].tolist() == [6, 5]
    assert out[0]["draft_probs"].shape == (0, 0)  # drafts without probabilities
    assert isinstance(out[1], RuntimeError)  # the suffix call failed: its row alone
    assert out[3]["draft_token_ids"].size == 0 and out[4]["draft_token_ids"].size == 0
    assert isinstance(out[5], ValueError) and "'magic' is not one of none, draft, ngram, suffix, hybrid" in str(out[5])
    assert isinstance(out[6], ValueError) and "token ids" in str(out[6])


def test_a_release_gives_every_proposer_the_final_ids(draft):
    released = []
    for name, p in draft.proposers.items():
        p_release = p.release
        p.release = lambda seq, final=None, _n=name, _r=p_release: released.append((_n, seq, final)) or _r(seq, final)
    try:
        out = draft.run_batch([_row(8, [1, 2, 3, -1, -1], "suffix", release=True)])
    finally:
        for p in draft.proposers.values():
            del p.release
    assert out[0]["draft_token_ids"].size == 0
    assert {n for n, *_ in released} >= {"draft", "ngram", "suffix", "hybrid"}
    assert all(seq == 8 and final == [1, 2, 3] for n, seq, final in released if n in draft.proposers)


def test_proposer_gauges_are_exported(draft):
    draft.run_batch([_row(9, [1, 2, 1], "suffix")])
    assert draft.metrics.get("spec_decode_suffix_active_requests") >= 1
    draft.run_batch([_row(9, [1, 2, 1, 2], "suffix", release=True)])
    assert draft.metrics.get("spec_decode_suffix_active_requests") == 0
    assert draft.metrics.get("spec_decode_suffix_cached_responses") >= 1


def test_proposals_are_returned_as_tensors_per_row():
    from spec_decode.serving.draft_model import _outputs

    out = _outputs(Proposal.of([3, 4]))
    assert out["draft_token_ids"].dtype == np.int64 and out["draft_probs"].shape == (0, 0)
    assert out["draft_parents"].tolist() == [-1, 0] and out["draft_parents"].dtype == np.int32
    out = _outputs(Proposal.of([3, 4, 5], None, [-1, -1, 1]))
    assert out["draft_parents"].tolist() == [-1, -1, 1] and out["draft_parents"].dtype == np.int32
    assert _outputs(Proposal.empty())["draft_parents"].size == 0


def test_a_release_with_ids_that_are_not_token_ids_frees_the_caches_and_adds_nothing(draft):
    draft.run_batch([_row(10, [1, 2, 1], "suffix")])
    cached = draft.metrics.get("spec_decode_suffix_cached_responses")
    out = draft.run_batch([_row(10, [1, 2, 1, 2**40], "suffix", release=True)])
    assert out[0]["draft_token_ids"].size == 0  # answered, not an error: the sequence's caches are gone
    assert draft.metrics.get("spec_decode_suffix_active_requests") == 0
    assert draft.metrics.get("spec_decode_suffix_cached_responses") == cached


@pytest.mark.parametrize("method, width", [("eagle", 32), ("eagle3", 96)])
def test_a_head_s_row_with_bad_hidden_states_fails_alone_naming_the_input(tiny_heads, tiny_dir, method, width):
    """Rows of a head served from speculator_path (target_model_path from target_model's parameters): bad hidden
    states fail their own row, huge finite ones draft from finite distributions."""
    draft = DraftBackend({"draft_model_path": "", "suffix_backend": "python", "device": "cpu",
                          "speculator_path": str(tiny_heads[method]), "speculator_min_token_prob": "0"},
                         target_params={"model_path": str(tiny_dir)})
    assert list(draft.proposers)[-2:] == [method, "hybrid"]

    def row(seq, hidden):
        return _row(seq, [4, 8, 1], method, context_hidden_states=hidden.astype(np.float32),
                    num_context_hidden_states=np.array([len(hidden)], np.int32))

    out = draft.run_batch([row(1, np.random.randn(2, width)), row(2, np.random.randn(2, 31)),
                           row(3, np.full((1, width), np.nan)), row(4, np.random.randn(1, width)),
                           row(5, np.full((1, width), 1e38))])
    assert len(out[0]["draft_token_ids"]) == 3 and len(out[3]["draft_token_ids"]) == 3
    probs = np.asarray(out[4]["draft_probs"])  # huge but finite states: drafts only from finite distributions
    assert np.isfinite(probs).all() and np.allclose(probs.sum(-1), 1.0, atol=1e-4)
    assert isinstance(out[1], ValueError) and "context_hidden_states" in str(out[1]) and "[m, 32 x n]" in str(out[1])
    assert isinstance(out[2], ValueError) and "finite" in str(out[2])
    assert draft.metrics.get(f"spec_decode_{method}_cache_sequences") == 3  # rows 1, 4 and 5 hold contexts
    draft.run_batch([_row(s, [4, 8, 1, 2], method, release=True) for s in (1, 4, 5)])
    assert draft.metrics.get(f"spec_decode_{method}_cache_sequences") == 0


def test_a_head_that_does_not_fit_the_target_is_refused_at_load_naming_the_file_and_key(tiny_dir, tmp_path):
    from spec_decode.proposers.speculators import SpeculatorLoadError
    from tests.speculator_checkpoints.eagle import write_eagle1

    wide = write_eagle1(tmp_path / "wide", torch.randn(97, 48), 4, 2, 64)  # hidden 48: the target's is 32
    with pytest.raises(SpeculatorLoadError, match=rf"{wide / 'config.json'}.*'hidden_size'.*48.*32"):
        DraftBackend({"draft_model_path": "", "suffix_backend": "python", "device": "cpu",
                      "speculator_path": str(wide)}, target_params={"model_path": str(tiny_dir)})


def test_draft_parents_for_tree_and_chain_rows_and_releases(draft):
    """``draft_tree`` (absent: False) reaches the proposer; ``draft_parents`` INT32 is the tree's parents, a chain's
    [-1, 0, ...], or empty (no drafts, a release)."""
    tree = np.array([True])
    ids = [5, 6, 1, 2, 5, 6, 3, 5, 6]  # [5, 6] followed by 1 2 then by 3 5 6: n-gram lookup's two branches
    out = draft.run_batch([_row(20, ids, "ngram", k=5, draft_tree=tree), _row(21, ids, "ngram", k=5),
                           _row(22, [5, 6, 7], "draft", k=3, draft_tree=tree), _row(23, [1, 2], "none"),
                           _row(24, [7, 8, 9], "suffix", k=3, draft_tree=tree)])
    assert out[0]["draft_token_ids"].tolist() == [3, 5, 6, 1, 2]
    assert out[0]["draft_parents"].tolist() == [-1, 0, 1, -1, 3] and out[0]["draft_parents"].dtype == np.int32
    assert out[1]["draft_token_ids"].tolist() == [3, 5, 6] and out[1]["draft_parents"].tolist() == [-1, 0, 1]
    # the draft LM (the tiny target drafting for itself) branches at its unsure first position
    assert len(out[2]["draft_token_ids"]) == 3 and out[2]["draft_parents"].tolist() == [-1, -1, 0]
    for o in out[1:]:
        assert o["draft_parents"].dtype == np.int32 and len(o["draft_parents"]) == len(o["draft_token_ids"])
    assert out[3]["draft_parents"].size == 0 and out[4]["draft_parents"].size == 0  # none; suffix: no match
    released = draft.run_batch([_row(s, [5, 6, 7, 8], m, release=True) for s, m in ((22, "draft"), (24, "suffix"))])
    for o in released:
        assert o["draft_parents"].dtype == np.int32 and o["draft_parents"].size == 0
        assert set(o) == {"draft_token_ids", "draft_parents", "draft_probs"}


def test_a_row_s_tree_top_k_and_tree_depth_shape_its_tree_and_are_range_checked(draft):
    """tree_top_k / tree_depth (optional INT32) reach the proposer: the draft LM (the tiny target drafting for itself)
    branching into 1 is its chain; a depth of 1 keeps every node at the first level. Out of range: that row fails,
    naming the input and its range, and the others are drafted."""
    ids = [5, 6, 7]
    tree = np.array([True])
    out = draft.run_batch([_row(30, ids, "draft", k=3, draft_tree=tree, tree_top_k=np.array([1], np.int32)),
                           _row(31, ids, "draft", k=3),
                           _row(32, ids, "draft", k=3, draft_tree=tree, tree_top_k=np.array([3], np.int32),
                                tree_depth=np.array([1], np.int32)),
                           _row(33, ids, "draft", k=3, draft_tree=tree, tree_top_k=np.array([11], np.int32))])
    assert out[0]["draft_token_ids"].tolist() == out[1]["draft_token_ids"].tolist()
    assert out[0]["draft_parents"].tolist() == [-1, 0, 1][: len(out[0]["draft_token_ids"])]
    assert out[2]["draft_parents"].tolist() == [-1, -1, -1]
    assert isinstance(out[3], Exception) and "tree_top_k" in str(out[3]) and "[0, 10]" in str(out[3])
    draft.run_batch([_row(s, ids, "draft", release=True) for s in (30, 31, 32, 33)])


def test_a_suffix_tree_row_gets_both_branches(draft):
    p = [1, 2, 3, 11, 12]  # followed by 4 5 10, 4 5 20 and 7 8 6; the prompt ends with it (a 5-token match)
    prompt = p + [4, 5, 10] + p + [4, 5, 20] + p + [7, 8, 6] + p
    (o,) = draft.run_batch([_row(25, prompt, "suffix", k=5, draft_tree=np.array([True]))])
    tokens, parents = o["draft_token_ids"].tolist(), o["draft_parents"].tolist()
    assert tokens[:2] == [4, 5] and parents[:2] == [-1, 0] and len(tokens) == 5
    assert 7 in tokens and parents[tokens.index(7)] == -1
    (chain,) = draft.run_batch([_row(26, prompt, "suffix", k=5)])
    assert chain["draft_token_ids"].tolist()[:2] == [4, 5] and chain["draft_parents"].tolist() == [-1, 0, 1, 2, 3][
        : len(chain["draft_token_ids"])]
    from spec_decode.tree import check_tree

    check_tree(tokens, parents)
    draft.run_batch([_row(s, prompt, "suffix", release=True) for s in (25, 26)])
