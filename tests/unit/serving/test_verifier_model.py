"""spec_decode.serving.verifier_model: a round's rows verified in one sampler call, each row as if alone."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from spec_decode.serving.adapter import stack_rows
from spec_decode.serving.verifier_model import VerifierBackend


@pytest.mark.parametrize("k_rows", [[0, 4], [2, 0, 3]])
def test_verifier_rows_padded_to_the_rounds_largest_k_equal_unpadded_rows(k_rows):
    """A verifier row cut from a padded batch (drafts padded with -1, probabilities with zero rows) gives what the
    same row gives alone, for drafts with and without draft probabilities mixed in one round."""
    gen = torch.Generator().manual_seed(0)
    vocab = 11
    ver = VerifierBackend({"backend": "torch", "num_threads": "0"})  # 0: leave the test process's threads alone
    rows = []
    for i, k in enumerate(k_rows):
        tp = torch.softmax(torch.randn(k + 1, vocab, generator=gen), -1)
        drafts = torch.randint(0, vocab, (k,), generator=gen)
        dp = torch.softmax(torch.randn(k, vocab, generator=gen), -1) if i % 2 else torch.zeros(0, 0)
        rows.append({"target_probs": tp, "draft_token_ids": drafts.numpy(), "draft_probs": dp,
                     "temperature": np.array([1.0], np.float32), "random_seed": np.array([7 + i]),
                     "step": np.array([3]), "acceptance_method": np.array([b"rejection"], object)})
    alone = [ver.run(r) for r in rows]
    batch = {name: stack_rows([r[name] for r in rows])
             for name in ("target_probs", "draft_token_ids", "draft_probs")}
    for i, r in enumerate(rows):
        padded = dict(r, target_probs=batch["target_probs"][i], draft_token_ids=batch["draft_token_ids"][i],
                      draft_probs=batch["draft_probs"][i])
        got = ver.run(padded)
        assert got["output_ids"].tolist() == alone[i]["output_ids"].tolist()
        np.testing.assert_allclose(got["output_log_probs"], alone[i]["output_log_probs"], rtol=1e-6)


@pytest.mark.parametrize("backend", ["torch", "triton"])  # triton: the kernels under TRITON_INTERPRET=1
def test_a_round_is_verified_in_one_sampler_call_and_each_row_gets_what_it_gets_alone(backend, monkeypatch):
    """Rows of k 1..4, greedy and sampled, with and without draft probabilities, rejection and typical: run_batch
    gives each row the tokens run() gives it alone, with one sampler call per kind of row; a bad row fails alone."""
    import spec_decode.verifier.verifier as step
    calls = []
    for name in ("rejection_sample", "typical_acceptance_sample"):
        real = getattr(step, name)
        monkeypatch.setattr(step, name, lambda *a, _real=real, _name=name, **kw: calls.append(_name) or _real(*a, **kw))
    gen = torch.Generator().manual_seed(1)
    vocab = 23
    ver = VerifierBackend({"backend": backend, "num_threads": "0"})
    rows = []
    for i in range(12):
        k = 1 + i % 4
        tp = torch.softmax(torch.randn(k + 1, vocab, generator=gen) * 2, -1)
        drafts = torch.argmax(tp[:k] / torch.empty(k, vocab).exponential_(generator=gen), -1)  # often accepted
        with_dp, method = i % 3 == 1, b"typical" if i % 3 == 2 else b"rejection"
        dp = torch.softmax(torch.randn(k, vocab, generator=gen), -1) if with_dp else torch.zeros(0, 0)
        rows.append({"target_probs": tp, "draft_token_ids": drafts.numpy(), "draft_probs": dp,
                     "temperature": np.array([0.0 if i % 5 == 0 else 1.0], np.float32),
                     "random_seed": np.array([100 + i]), "step": np.array([i]),
                     "acceptance_method": np.array([method], object)})
    alone = [ver.run(r) for r in rows]
    calls.clear()
    bad = dict(rows[0], target_probs=torch.ones(1, vocab) / vocab)  # 1 row of probabilities for 1 draft
    got = ver.run_batch(rows + [bad])
    # three kinds of row: rejection without and with draft probabilities, typical (its greedy rows: rejection)
    assert sorted(calls) == ["rejection_sample", "rejection_sample", "typical_acceptance_sample"]
    assert isinstance(got[-1], ValueError) and "target_probs" in str(got[-1])
    for g, a in zip(got[:-1], alone):
        assert g["output_ids"].tolist() == a["output_ids"].tolist()
        np.testing.assert_allclose(g["output_log_probs"], a["output_log_probs"], rtol=1e-6)
    assert sum(len(g["output_ids"]) - 1 for g in got[:-1]) > 0  # some drafts were accepted


def test_a_greedy_row_sent_as_its_argmax_verifies_as_its_full_distributions_do():
    """target_model sends a greedy row without log-probs as its k+1 argmax ids and their probabilities; the verifier's
    argmax walk over them gives the ids and log-probs the full [k+1, V] rows give, ties (lowest index) and drafts
    past the target's rows included, in a round that mixes both forms."""
    gen = torch.Generator().manual_seed(1)
    ver = VerifierBackend({"backend": "torch", "num_threads": "0"})
    for case in range(60):
        k, vocab = case % 5, 7
        logits = torch.randint(0, 3, (k + 1, vocab), generator=gen).float()  # many exact ties
        tp = torch.softmax(logits, -1)
        best = tp.argmax(-1)
        drafts = [int(best[i]) if torch.rand((), generator=gen) < 0.7 else int(torch.randint(0, vocab, (),
                  generator=gen)) for i in range(k)]
        if case % 7 == 0:
            drafts.append(vocab + 3)  # outside the vocabulary: the target did not score it (both paths cut it)
        base = {"draft_token_ids": np.array(drafts, np.int64), "draft_probs": torch.zeros(0, 0),
                "temperature": np.array([0.0], np.float32), "random_seed": np.array([0]), "step": np.array([0]),
                "acceptance_method": np.array([b"rejection"], object)}
        full = ver.run(base | {"target_probs": tp[: k + 1]})
        compact = base | {"target_probs": torch.zeros(0, 0), "target_argmax": best.numpy(),
                          "target_argmax_probs": tp.gather(-1, best[:, None])[:, 0].numpy()}
        got = ver.run(compact)
        assert got["output_ids"].tolist() == full["output_ids"].tolist()
        np.testing.assert_array_equal(got["output_log_probs"], full["output_log_probs"])
        # the same row batched beside a full one (its target_probs padded with zero rows, the other's argmax with -1)
        other = base | {"target_probs": tp, "target_argmax": np.zeros(0, np.int64),
                        "target_argmax_probs": np.zeros(0, np.float32)}
        batch = {name: stack_rows([np.asarray(r[name]) for r in (compact, other)]) for name in
                 ("target_probs", "draft_token_ids", "draft_probs", "target_argmax", "target_argmax_probs")}
        rows = [{**base, **{n: v[i] for n, v in batch.items()}} for i in range(2)]
        a, b = ver.run_batch(rows)
        assert a["output_ids"].tolist() == b["output_ids"].tolist() == full["output_ids"].tolist()


def _tree_row(gen: torch.Generator, vocab: int = 13):
    """A greedy tree row whose argmax path runs through the second root-level node, then its second child: target
    probabilities, drafts, parents and the emitted ids."""
    tp = torch.softmax(torch.randn(6, vocab, generator=gen) * 3, -1)
    best = tp.argmax(-1).tolist()
    drafts = [(best[0] + 1) % vocab, best[0], (best[2] + 1) % vocab, best[2], best[1]]
    return tp, drafts, [-1, -1, 1, 1, 0], [best[0], best[2], best[4]]


def test_a_tree_row_is_walked_down_its_tree_and_its_log_probs_come_from_the_accepted_paths_rows():
    """draft_parents (INT32) makes a row's drafts a tree: full distributions and the argmax form give the argmax path,
    log-probs and top-N alternatives from its rows (1 + node), raw log-prob rows too; in a batch, a tree row padded
    beside a chain (parents padded with -1, the chain's sent explicitly) gets what it gets alone; bad parents fail
    their row alone, naming draft_parents."""
    from spec_decode import tree
    from spec_decode.processors import ProcessorSpec

    gen = torch.Generator().manual_seed(4)
    ver = VerifierBackend({"backend": "torch", "num_threads": "0"})
    tp, drafts, parents, expected = _tree_row(gen)
    rows = tree.rows_of(tree.accepted_nodes(drafts, parents, expected))
    assert rows == [0, 2, 4]
    base = {"draft_token_ids": np.array(drafts, np.int64), "draft_probs": torch.zeros(0, 0),
            "draft_parents": np.array(parents, np.int32), "temperature": np.array([0.0], np.float32),
            "random_seed": np.array([0]), "step": np.array([0]), "acceptance_method": np.array([b"rejection"], object)}
    full = ver.run(base | {"target_probs": tp})
    assert full["output_ids"].tolist() == expected
    np.testing.assert_allclose(full["output_log_probs"], torch.log(tp[rows, expected]).numpy(), rtol=1e-6)
    compact = ver.run(base | {"target_probs": torch.zeros(0, 0), "target_argmax": tp.argmax(-1).numpy(),
                              "target_argmax_probs": tp.max(-1).values.numpy()})
    assert compact["output_ids"].tolist() == expected
    np.testing.assert_allclose(compact["output_log_probs"], full["output_log_probs"], rtol=1e-6)
    spec = np.array([ProcessorSpec(3, logprobs=True, top_logprobs=2).wire_text.encode()], object)
    raw = torch.log_softmax(torch.randn(6, 13, generator=gen), -1)
    for log_rows, source in ((None, torch.log(tp)), (raw, raw)):
        extra = {} if log_rows is None else {"log_probs": log_rows}
        got = ver.run(base | {"target_probs": tp, "logits_processors": spec} | extra)
        assert got["output_ids"].tolist() == expected
        np.testing.assert_allclose(got["output_log_probs"], source[rows, expected].numpy(), rtol=1e-6)
        np.testing.assert_array_equal(got["top_log_prob_ids"], source[rows].topk(2, -1).indices.numpy())
        np.testing.assert_array_equal(got["output_token_ranks"], (source[rows] > source[rows, expected][:, None])
                                      .sum(-1).numpy() + 1)
    # batched beside a sampled chain row of k = 2 (parents padded with -1), and beside rows with bad parents
    chain = base | {"target_probs": torch.softmax(torch.randn(3, 13, generator=gen), -1),
                    "draft_token_ids": np.array([1, 2], np.int64), "draft_parents": np.array([-1, 0], np.int32),
                    "temperature": np.array([1.0], np.float32), "random_seed": np.array([9])}
    tree_row = base | {"target_probs": tp}
    batch = {name: stack_rows([np.asarray(r[name]) for r in (tree_row, chain)])
             for name in ("target_probs", "draft_token_ids", "draft_parents")}
    padded = [tree_row | {n: v[0] for n, v in batch.items()}, chain | {n: v[1] for n, v in batch.items()}]
    assert padded[1]["draft_parents"].tolist() == [-1, 0, -1, -1, -1]
    bad = [tree_row | {"draft_parents": np.array([-1, 3, 0, 1, 0], np.int32)},
           tree_row | {"draft_parents": np.array([-1, -1], np.int32)},
           base | {"target_probs": torch.zeros(0, 0), "target_argmax": tp.argmax(-1).numpy(),
                   "target_argmax_probs": tp.max(-1).values.numpy(), "draft_parents": np.array([-1, -1, 1, 1, 4])}]
    got = ver.run_batch(padded + bad)
    assert got[0]["output_ids"].tolist() == expected
    assert got[1]["output_ids"].tolist() == ver.run(chain)["output_ids"].tolist()
    for err, what in zip(got[2:], ("node 1's parent must lie in", "one parent per draft", "node 4's parent")):
        assert isinstance(err, ValueError) and "draft_parents" in str(err) and what in str(err)


def test_an_argmax_row_with_fewer_probabilities_than_ids_fails_alone_naming_them():
    """A direct caller's greedy row whose target_argmax_probs is shorter than target_argmax is refused, naming it."""
    from spec_decode.serving.verifier_model import VerifierBackend

    backend = VerifierBackend({})
    bad = {"target_probs": np.zeros((0, 0), np.float32), "draft_token_ids": np.array([5, 6, 7, 8]),
           "target_argmax": np.array([5, 6, 9, 9, 9]), "target_argmax_probs": np.array([0.9], np.float32)}
    good = dict(bad, target_argmax_probs=np.full(5, 0.9, np.float32))
    out = backend.run_batch([bad, good])
    assert isinstance(out[0], ValueError) and "target_argmax_probs" in str(out[0])
    assert out[1]["output_ids"].tolist() == [5, 6, 9]
