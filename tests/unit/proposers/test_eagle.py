"""spec_decode.proposers.eagle: the heads ``speculator_path`` serves (a published EAGLE-1 head, method ``eagle``; an
EAGLE-3 head, method ``eagle3``), their per-sequence contexts (steps that accept 0..k drafts, rollbacks, retries,
evictions), the training unroll against live drafting, their drafts (greedy and sampled: the distributions they
return are the ones they sampled from), and the target's own output through the served backends.

The loaders' maths against the published layouts is tests/unit/proposers/test_eagle_published.py."""

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from spec_decode.engine.draft_vocab import DraftVocab
from spec_decode.proposers import Eagle3Head, Eagle3Proposer, EagleProposer, ProposalRequest
from spec_decode.proposers.eagle import REPORT_FILE, artifacts, load_eagle3
from spec_decode.proposers.speculators import SpeculatorLoadError, SpeculatorSettings, TargetInfo, served_heads
from spec_decode.sampling import SamplingParams
from spec_decode.training.speculator import unrolled_outputs
from tests.helpers import assert_cut_by_rule, confidence_rule, save_tiny_eagle, tiny_head_params
from tests.speculator_checkpoints.eagle import write_eagle3

DRAFT = list(range(0, 96, 2))  # the EAGLE-3 head's draft vocabulary: 48 of the tiny target's 97 tokens (write_eagle3)
HEADS = ("eagle", "eagle3")
PROPOSER = {"eagle": EagleProposer, "eagle3": Eagle3Proposer}
# the wire's hidden-state width per head served alone: [last hidden state] (EAGLE-1), [last; inputs of layers 0, 1]
# (the EAGLE-3 head reads layers [0, 1, 1] of the 2-layer tiny target)
WIDTH = {"eagle": 32, "eagle3": 96}


@pytest.fixture(scope="module")
def head_dirs(tiny_lm, tmp_path_factory):
    """A published EAGLE-1 head (authors' layout) and an EAGLE-3 head over the tiny target, random weights."""
    root = tmp_path_factory.mktemp("heads")
    return {"eagle": save_tiny_eagle(tiny_lm, root / "eagle"),
            "eagle3": write_eagle3(root / "eagle3", 32, 97, 4, 2, 64, len(DRAFT), layer_ids=[0, 1, 1])}


def _settings(folder, tiny_dir, min_token_prob=0.0, max_sequences=64):
    return SpeculatorSettings(speculator_path=str(folder), target_model_path=str(tiny_dir), device="cpu",
                              speculator_min_token_prob=min_token_prob, max_sequences=max_sequences)


def _proposer(method, head_dirs, tiny_dir, min_token_prob=0.0, max_sequences=64):
    p = PROPOSER[method].from_config(_settings(head_dirs[method], tiny_dir, min_token_prob, max_sequences), {})
    assert p is not None and type(p) is PROPOSER[method]
    return p


@torch.no_grad()
def _reference(model, vocab, ids, states, first, k):
    """Greedy drafts by plain recomputation, without caches: the pairs first..n-1 of the target's states, then each
    draft's pair (the head's own output, the drafted token), the whole sequence of pairs run again per draft."""
    n = len(ids) - 1
    zs = [model.pair_inputs(model.features(states), torch.tensor(ids[first + 1 :]))]
    pos = [torch.arange(first, n)]
    out = []
    for i in range(k):
        z, p = torch.cat(zs)[None], torch.cat(pos)[None]
        a = model.layer(z, p, torch.ones(z.shape[1], z.shape[1], dtype=torch.bool).tril()[None, None])[0][0, -1:]
        tok = int(vocab.token_ids[int(model.logits(a).argmax())])
        out.append(tok)
        zs.append(model.pair_inputs(a, torch.tensor([tok])))
        pos.append(torch.tensor([n + i]))
    return out


def test_speculator_path_serves_each_folder_as_its_layout_s_method_and_auto_the_trained_head(
        head_dirs, tiny_dir, tmp_path, monkeypatch):
    e1, e3 = head_dirs["eagle"], head_dirs["eagle3"]
    assert served_heads(f"{e1},{e3}") == {"eagle": e1, "eagle3": e3} == served_heads(f" {e1} : {e3} ")
    assert served_heads("") == {} == served_heads("none") == served_heads("auto")  # no trained head here (conftest)
    assert EagleProposer.configured(_settings(e1, tiny_dir)) and not Eagle3Proposer.configured(_settings(e1, tiny_dir))
    assert Eagle3Proposer.configured(_settings(e3, tiny_dir)) and not EagleProposer.configured(_settings(e3, tiny_dir))
    assert not EagleProposer.configured(_settings(e1 / "x", tiny_dir))  # unreadable: not offered, loading says why
    assert EagleProposer.from_config(_settings(e3, tiny_dir), {}) is None
    with pytest.raises(SpeculatorLoadError, match="no such folder"):
        served_heads(str(e1 / "x"))
    with pytest.raises(SpeculatorLoadError, match="a second eagle head"):
        served_heads(f"{e1},{e1}")
    # auto: the head make speculator trained (its folder holds the training report), replaced by a later eagle3 folder
    trained = tmp_path / "trained"
    write_eagle3(trained, 32, 97, 4, 2, 64, len(DRAFT), layer_ids=[0, 1, 1], seed=5)
    monkeypatch.setattr(artifacts, "default_eagle_dir", lambda: trained)
    assert served_heads("auto") == {}  # not finished: no report yet
    (trained / REPORT_FILE).write_text("{}")
    assert served_heads("auto") == {"eagle3": trained}
    assert served_heads(f"auto,{e3},{e1}") == {"eagle3": e3, "eagle": e1}
    with pytest.raises(SpeculatorLoadError, match="a second eagle3 head"):
        served_heads(f"{e3},auto")


def test_the_trained_head_s_folder_round_trips(tiny_lm, tmp_path):
    """Eagle3Head.save writes the published EAGLE-3 layout: load_eagle3 gives back the same head and vocabulary (float32
    exactly, float16 as published to its precision), with or without its own copy of the target's embedding."""
    torch.manual_seed(3)
    config = {"hidden_size": 32, "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 64,
              "rms_norm_eps": 1e-6, "draft_vocab_size": len(DRAFT), "rope_theta": 10000.0,
              "max_position_embeddings": 1024}
    head = Eagle3Head(tiny_lm.get_input_embeddings().weight.detach(), config, 3, [1, 2, 2]).eval()
    with torch.no_grad():
        for name in ("input_norm", "hidden_norm", "post_norm", "norm"):
            getattr(head, name).weight.normal_(1.0, 0.1)
    vocab = DraftVocab(DRAFT, 97)
    target = TargetInfo.from_model(tiny_lm)
    f, t, p = torch.randn(2, 6, 96), torch.randint(0, 97, (2, 6)), torch.arange(6).repeat(2, 1)
    for dtype, embedded, tol in ((torch.float32, True, {"atol": 0, "rtol": 0}),
                                 (torch.float16, False, {"atol": 2e-2, "rtol": 2e-2})):
        folder = tmp_path / str(dtype)
        head.save(folder, vocab, [0, 1, 1], extra={"note": "x"}, dtype=dtype, with_embedding=embedded)
        loaded, got = load_eagle3(folder, target)
        assert got.token_ids.tolist() == DRAFT and got.target_vocab_size == 97
        assert loaded.aux_columns == [1, 2, 2]  # layers 0, 1, 1 of the wire's [last; layer 0; layer 1]
        with torch.no_grad():
            torch.testing.assert_close(loaded.logits(loaded(loaded.features(f), t, p)),
                                       head.logits(head(head.features(f), t, p)), **tol)
        torch.testing.assert_close(loaded.embedding, tiny_lm.get_input_embeddings().weight.detach())


@pytest.mark.parametrize("method", HEADS)
def test_contexts_follow_the_committed_ids_through_accepts_rollbacks_retries_and_evictions(head_dirs, tiny_dir,
                                                                                          method):
    """Greedy drafts equal plain recomputation over the pairs the context should hold: it grows by each step's states
    (observed steps too), a retry or a rollback cuts it to the committed ids, and a context that lost pairs (evicted,
    or a step that skipped this proposer) starts again at the first state the step brings."""
    p = _proposer(method, head_dirs, tiny_dir, max_sequences=2)
    model, vocab = p.model, p.vocab
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 97, (12,), generator=g).tolist()
    f = torch.randn(64, WIDTH[method], generator=g)  # the target's states at each position (as if they were)

    def step(seq, ids, first, k=4):
        (out,) = p.propose([ProposalRequest(seq, ids, k, SamplingParams(), 0, f[first : len(ids) - 1])])
        return out.draft_token_ids.tolist()

    first = step(1, ids, 10)
    assert first == _reference(model, vocab, ids, f[10:11], 10, 4)  # the first drafting step: one state
    assert set(first) <= set(vocab.token_ids.tolist())
    ids2 = ids + [3, 5, 7]  # accepted two drafts and a bonus: states of positions 11..13 come
    assert step(1, ids2, 11) == _reference(model, vocab, ids2, f[10:14], 10, 4)
    assert step(1, ids2, 11) == _reference(model, vocab, ids2, f[10:14], 10, 4)  # a retry of the same step
    ids3 = ids2 + [9]  # accepted nothing: the bonus only
    assert step(1, ids3, 14) == _reference(model, vocab, ids3, f[10:15], 10, 4)
    rolled = ids2[:-1] + [11, 13]  # the committed ids moved on another way (a replayed sequence): cut back to them
    assert step(1, rolled, 13) == _reference(model, vocab, rolled, f[10:15], 10, 4)
    step(2, ids, 10)
    step(3, ids, 10)  # max_sequences = 2: sequence 1's context is evicted
    assert 1 not in p._contexts
    gap = rolled + [2, 4, 6]  # its next step finds no context: it starts at the first state this step brings
    assert step(1, gap, 15) == _reference(model, vocab, gap, f[15:18], 15, 4)
    assert p.gauges() == {f"spec_decode_{method}_cache_sequences": 2, f"spec_decode_{method}_cache_pairs": 1 + 3}
    assert set(p.gauges()) == set(p.GAUGES)
    more = gap + [8, 10]  # a step hybrid drafted with suffix decoding: observed, so the next step's context is whole
    p.observe([ProposalRequest(1, more, 4, SamplingParams(), 0, f[18:20])])
    last = more + [12]
    assert step(1, last, 20) == _reference(model, vocab, last, f[15:21], 15, 4)
    p.release(1)
    p.release(1)  # idempotent
    assert p.gauges()[f"spec_decode_{method}_cache_sequences"] == 1


@pytest.mark.parametrize("method", HEADS)
def test_a_round_s_sequences_draft_as_they_would_alone(head_dirs, tiny_dir, method):
    p = _proposer(method, head_dirs, tiny_dir)
    g = torch.Generator().manual_seed(1)
    reqs = [ProposalRequest(s, torch.randint(0, 97, (5 + 3 * s,), generator=g).tolist(), 1 + s % 4,
                            SamplingParams() if s % 2 else SamplingParams(temperature=1.0, seed=s), 0,
                            torch.randn(1 + s, WIDTH[method], generator=g)) for s in range(6)]
    together = p.propose(reqs)
    for r, t in zip(reqs, together):
        alone = _proposer(method, head_dirs, tiny_dir).propose([r])[0]
        assert t.draft_token_ids.tolist() == alone.draft_token_ids.tolist() and len(t.draft_token_ids) == r.k
        torch.testing.assert_close(t.draft_probs, alone.draft_probs, atol=1e-5, rtol=1e-4)
    assert p.propose([ProposalRequest(9, [4, 8], 3, SamplingParams(), 0, None)])[0].draft_token_ids.numel() == 0
    probs = together[3].draft_probs
    assert probs.shape == (4, 97) and torch.allclose(probs.sum(-1), torch.ones(4))
    outside = [t for t in range(97) if t not in p.vocab.token_ids.tolist()]
    assert (probs[:, outside] == 0).all() and len(outside) == (0 if method == "eagle" else 97 - len(DRAFT))


@pytest.mark.parametrize("method", HEADS)
def test_the_training_unroll_is_what_drafting_computes(head_dirs, tiny_dir, method):
    """unrolled_outputs' step d at pair j is the output live drafting has at its (d+1)-th draft when the context held
    the target's pairs up to j - d and the drafts were the true tokens (EAGLE-3's training-time test)."""
    model = _proposer(method, head_dirs, tiny_dir).model
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(0, 97, (14,), generator=g).tolist()
    f = model.features(torch.randn(13, WIDTH[method], generator=g))  # what the head reads of the wire's states
    tokens = torch.tensor(ids[1:])[None]  # pair j's token x_{j+1} (both heads embed target ids)
    with torch.no_grad():
        outs = unrolled_outputs(model, f[None], tokens, torch.arange(13)[None], 3)
        for d in range(3):
            for j in range(d, 13):
                # live: context pairs 0..j-d from the target, then d pairs from the head's own outputs
                z = [model.pair_inputs(f[: j - d + 1], tokens[0, : j - d + 1])]
                a = None
                for e in range(d + 1):
                    zz = torch.cat(z)[None]
                    t = zz.shape[1]
                    a = model.layer(zz, torch.arange(t)[None], torch.ones(t, t, dtype=torch.bool).tril()[None, None])
                    a = a[0][0, -1:]
                    if e < d:
                        z.append(model.pair_inputs(a, tokens[0, j - d + 1 + e : j - d + 2 + e]))
                # (the published heads' random layers are sharp: float32 rounding of another summation order shows)
                torch.testing.assert_close(outs[d][0, j : j + 1], a, atol=1e-3, rtol=1e-3)


@pytest.mark.parametrize("method", HEADS)
def test_a_step_drafts_while_its_confidence_holds_and_scores_its_drafts(head_dirs, tiny_dir, method):
    """With speculator_min_token_prob = t, each proposal is the prefix of the every-slot proposal up to the first slot
    i where (product of the drafts' probabilities before i) x (slot i's top probability) < t; its score is the sum of
    its drafts' running probabilities (greedy and sampled rows alike)."""
    hidden = torch.randn(40, WIDTH[method]) * 3
    reqs = [ProposalRequest(i, [4, 8], 3, SamplingParams() if i % 2 else SamplingParams(temperature=1.0, seed=i), 0,
                            hidden[i : i + 1]) for i in range(40)]
    every = _proposer(method, head_dirs, tiny_dir).propose(reqs)
    running, confidence = confidence_rule(every)
    t = float(torch.stack([c[0] for c in confidence]).median())  # about half the rows draft nothing
    cut = _proposer(method, head_dirs, tiny_dir, t).propose(reqs)
    lengths = assert_cut_by_rule(every, cut, running, confidence, t)
    assert 0 in lengths and max(lengths) > 0  # the rule cut some rows, not all
    with pytest.raises(ValueError, match="speculator_min_token_prob"):
        SpeculatorSettings(speculator_min_token_prob=1.5)


@pytest.mark.parametrize("method", HEADS)
def test_sampled_drafts_come_from_the_distributions_they_return(head_dirs, tiny_dir, method):
    """The first draft's frequencies over 2000 seeds match its draft_probs (chi-square): rejection sampling, exact
    for any q it is given with its drafts, then keeps the target's law."""
    p = _proposer(method, head_dirs, tiny_dir)
    hidden = torch.randn(1, WIDTH[method]) * 3
    reqs = [ProposalRequest(i, [4, 8], 1, SamplingParams(temperature=1.0, seed=i), 0, hidden) for i in range(2000)]
    out = p.propose(reqs)
    q = out[0].draft_probs[0].double()
    assert all(torch.allclose(o.draft_probs[0].double(), q) for o in out[:50])  # the same state: the same q
    counts = np.bincount([int(o.draft_token_ids[0]) for o in out], minlength=97)
    q = q.numpy()
    assert counts[q == 0].sum() == 0 and (q > 0).sum() > 1  # never outside its support; a law, not one token
    big = q * len(out) >= 5  # the rest pooled into one bin
    observed, expected = np.append(counts[big], counts[~big].sum()), np.append(q[big], q[~big].sum()) * len(out)
    assert chisquare(observed, expected * observed.sum() / expected.sum()).pvalue > 1e-3, (counts, q)


# 0: every slot. The other threshold sits among each random head's confidences at the second slot, so whether a step
# drafts it depends on the first sampled draft: the law must hold under that stopping rule too.
# tree: the requests allow trees; sampled ones still draft chains (Proposer.takes_tree), whose law this checks.
@pytest.mark.parametrize("method, min_token_prob, tree", [("eagle", 0.0, False), ("eagle", 0.00046, False),
                                                          ("eagle3", 0.0, False), ("eagle3", 0.2, False),
                                                          ("eagle3", 0.0, True)])
def test_through_the_served_backends_greedy_output_is_the_target_s_and_sampled_output_its_law(
        head_dirs, tiny_dir, tiny_lm, real_tokenizer, method, min_token_prob, tree):
    from spec_decode.generation import Generation
    from spec_decode.request import GenerationRequest
    from spec_decode.serving.draft_model import DraftBackend
    from spec_decode.serving.local_ensemble import LocalEnsemble
    from spec_decode.serving.target_model import TargetBackend
    from spec_decode.serving.verifier_model import VerifierBackend

    params = {"draft_model_path": "", "suffix_backend": "python", "device": "cpu",
              **tiny_head_params(head_dirs[method], tiny_dir, str(min_token_prob))}
    target = TargetBackend({"model_path": str(tiny_dir), "device": "cpu"}, draft_params=params)
    assert target.lm._aux.layers == ([0, 1] if method == "eagle3" else [])  # what the EAGLE-3 head reads
    ens = LocalEnsemble(DraftBackend(params), target, VerifierBackend({"backend": "torch", "num_threads": "0"}))

    def run(seq, prompt, n, **kw):
        req = GenerationRequest("x", n, speculative_method=method, num_draft_tokens=3, draft_tree=tree, **kw)
        gen = Generation(seq, prompt, req, real_tokenizer, [], 256, kw.get("random_seed", 0))
        while not gen.finished:
            (result,) = ens.run_round([gen.next_step()])
            gen.commit(result)
        ens.release([gen.next_step()])
        return gen

    prompt = [5, 17, 3, 9]
    gen = run(1, prompt, 20)
    with torch.inference_mode():
        ref = tiny_lm.generate(torch.tensor([prompt]), max_new_tokens=20, do_sample=False, eos_token_id=None,
                               pad_token_id=0)[0, 4:].tolist()
    assert gen.output_ids == ref and gen.stats.draft_tokens > 0
    # the second token is the first one a drafted step emits: its marginal law over seeds is the target's
    with torch.inference_mode():
        p1 = torch.softmax(tiny_lm(torch.tensor([prompt])).logits[0, -1].double(), -1)
        p2 = torch.softmax(tiny_lm(torch.tensor([[*prompt, t] for t in range(97)])).logits[:, -1].double(), -1)
    marginal = (p1[:, None] * p2).sum(0).numpy()
    n = 1000
    gens = [run(100 + s, prompt, 2, temperature=1.0, random_seed=s) for s in range(n)]
    counts = np.bincount([g.output_ids[1] for g in gens], minlength=97)
    drafted = {g.stats.draft_tokens for g in gens}  # the second step's drafts: 3 each, or fewer where the rule cut
    assert drafted == {3} if min_token_prob == 0 else len(drafted) > 1, drafted

    big = marginal * n >= 5  # the rest pooled into one bin
    observed, expected = counts[big], marginal[big] * n
    if (~big).any():
        observed, expected = np.append(observed, counts[~big].sum()), np.append(expected, marginal[~big].sum() * n)
    assert chisquare(observed, expected * observed.sum() / expected.sum()).pvalue > 1e-3, (counts, marginal)


@pytest.mark.parametrize("method", HEADS)
def test_hidden_states_of_another_shape_or_not_finite_are_refused_naming_the_input_and_long_ones_draft_less(
        head_dirs, tiny_dir, method):
    p = _proposer(method, head_dirs, tiny_dir)
    w = WIDTH[method]
    p.check(ProposalRequest(1, [4, 5, 6, 7], 2, SamplingParams(), 0, torch.randn(3, w)))
    fits = ProposalRequest(1, [4] * 1020, 4, SamplingParams(), 0, torch.randn(3, w))  # 1,024 positions: the target's
    p.check(fits)
    assert p.room(fits) == 4
    past = ProposalRequest(1, [4] * 1021, 4, SamplingParams(), 0, torch.randn(3, w))
    p.check(past)  # not refused: it drafts what fits (tests/unit/proposers/test_short_context.py)
    assert p.room(past) == 3
    p.check(ProposalRequest(1, [4], 2, SamplingParams(), 0, None))  # none yet: no drafts, no error
    with pytest.raises(ValueError, match=r"context_hidden_states.*\[m, 32 x n\].*\[2, 31\]"):
        p.check(ProposalRequest(1, [4, 5, 6], 2, SamplingParams(), 0, torch.randn(2, 31)))
    with pytest.raises(ValueError, match=rf"context_hidden_states.*m < 3.*\[3, {w}\]"):  # a state for the last token
        p.check(ProposalRequest(1, [4, 5, 6], 2, SamplingParams(), 0, torch.randn(3, w)))
    with pytest.raises(ValueError, match="context_hidden_states.*finite"):
        p.check(ProposalRequest(1, [4, 5], 2, SamplingParams(), 0, torch.full((1, w), float("nan"))))


def test_an_eagle3_row_without_the_head_s_layers_is_refused_naming_the_input(head_dirs, tiny_dir):
    """A target that does not return the EAGLE-3 head's layers (aux_hidden_state_layers: none) sends [m, H]: the row
    is refused naming its input, and the other rows of the call still draft."""
    import numpy as np

    from spec_decode.serving.draft_model import DraftBackend
    from tests.helpers import step_row

    p = _proposer("eagle3", head_dirs, tiny_dir)
    with pytest.raises(ValueError, match=r"context_hidden_states.*\[2, 32\]"):
        p.check(ProposalRequest(1, [4, 5, 6], 2, SamplingParams(), 0, torch.randn(2, 32)))
    draft = DraftBackend({"draft_model_path": "", "suffix_backend": "python", "device": "cpu",
                          **tiny_head_params(head_dirs["eagle3"], tiny_dir)})

    def row(seq, width):
        return step_row(seq, [4, 8, 1], num_draft_tokens=np.array([3], np.int32),
                        speculative_method=np.array([b"eagle3"], object),
                        context_hidden_states=np.random.randn(2, width).astype(np.float32),
                        num_context_hidden_states=np.array([2], np.int32))

    narrow, good = draft.run_batch([row(1, 32), row(2, 96)])
    assert isinstance(narrow, ValueError) and "context_hidden_states" in str(narrow)
    assert len(good["draft_token_ids"]) == 3
