"""spec_decode.proposers.eagle: the head, its folder, its per-sequence contexts (steps that accept 0..k drafts,
rollbacks, retries, evictions), the training unroll against live drafting, its drafts (greedy and sampled: the
distributions it returns are the ones it sampled from), and the target's own output through the served backends."""

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from spec_decode.engine.draft_vocab import DraftVocab
from spec_decode.proposers import EagleHead, EagleProposer, EagleSettings, ProposalRequest
from spec_decode.proposers.eagle import resolve_eagle_path
from spec_decode.sampling import SamplingParams
from spec_decode.training.speculator import unrolled_outputs
from tests.helpers import assert_cut_by_rule, confidence_rule, save_tiny_eagle, tiny_eagle_config

KEPT = list(range(0, 97, 2))  # 49 of the tiny target's 97 tokens


def _head(tiny_lm, seed=0):
    torch.manual_seed(seed)
    vocab = DraftVocab(KEPT, 97)
    emb = tiny_lm.get_input_embeddings().weight.detach()[vocab.token_ids]
    head = tiny_lm.get_output_embeddings().weight.detach()[vocab.token_ids]
    return EagleHead(torch.cat([emb, emb.mean(0, keepdim=True)]), head, tiny_eagle_config()).eval(), vocab


def _settings(folder, min_token_prob=0.0, max_sequences=64):
    return EagleSettings(eagle_path=str(folder), eagle_min_token_prob=min_token_prob, max_sequences=max_sequences)


@pytest.fixture
def eagle_dir(tiny_lm, tmp_path):
    return save_tiny_eagle(tiny_lm, tmp_path / "eagle", KEPT)


@torch.no_grad()
def _reference(model, vocab, ids, states, first, k):
    """Greedy drafts by plain recomputation, without caches: the pairs first..n-1 of the target's states, then each
    draft's pair (the head's own output, the drafted token), the whole sequence of pairs run again per draft."""
    n = len(ids) - 1
    zs = [model.pair_inputs(states, torch.tensor(vocab.map_ids(ids[first + 1 :])))]
    pos = [torch.arange(first, n)]
    out = []
    for i in range(k):
        z, p = torch.cat(zs)[None], torch.cat(pos)[None]
        a = model.layer(z, p, torch.ones(z.shape[1], z.shape[1], dtype=torch.bool).tril()[None, None])[0][0, -1:]
        tok = int(model.logits(a).argmax())
        out.append(KEPT[tok])
        zs.append(model.pair_inputs(a, torch.tensor([tok])))
        pos.append(torch.tensor([n + i]))
    return out


def test_the_folder_round_trips_and_the_path_resolves(eagle_dir, tiny_lm):
    model, vocab = EagleHead.load(eagle_dir)
    ref, _ = _head(tiny_lm)
    f, t, p = torch.randn(2, 6, 32), torch.randint(0, len(KEPT) + 1, (2, 6)), torch.arange(6).repeat(2, 1)
    torch.testing.assert_close(model(f, t, p), ref(f, t, p))
    assert model.logits(model(f, t, p)).shape == (2, 6, len(KEPT)) and vocab.token_ids.tolist() == KEPT
    assert resolve_eagle_path(str(eagle_dir)) == eagle_dir and resolve_eagle_path("") is None
    assert EagleProposer.configured(_settings(eagle_dir))
    assert not EagleProposer.configured(_settings(eagle_dir / "x"))
    with pytest.raises(FileNotFoundError):
        resolve_eagle_path(str(eagle_dir / "x"))


def test_contexts_follow_the_committed_ids_through_accepts_rollbacks_retries_and_evictions(tiny_lm):
    """Greedy drafts equal plain recomputation over the pairs the context should hold: it grows by each step's states
    (observed steps too), a retry or a rollback cuts it to the committed ids, and a context that lost pairs (evicted,
    or a step that skipped this proposer) starts again at the first state the step brings."""
    model, vocab = _head(tiny_lm)
    p = EagleProposer(model, vocab, 0.0, max_sequences=2)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 97, (12,), generator=g).tolist()
    f = torch.randn(64, 32, generator=g)  # the target's state at each position (as if it were)

    def step(seq, ids, first, k=4):
        (out,) = p.propose([ProposalRequest(seq, ids, k, SamplingParams(), 0, f[first : len(ids) - 1])])
        return out.draft_token_ids.tolist()

    assert step(1, ids, 10) == _reference(model, vocab, ids, f[10:11], 10, 4)  # the first drafting step: one state
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
    assert p.gauges() == {"spec_decode_eagle_cache_sequences": 2, "spec_decode_eagle_cache_pairs": 1 + 3}
    more = gap + [8, 10]  # a step hybrid drafted with suffix decoding: observed, so the next step's context is whole
    p.observe([ProposalRequest(1, more, 4, SamplingParams(), 0, f[18:20])])
    last = more + [12]
    assert step(1, last, 20) == _reference(model, vocab, last, f[15:21], 15, 4)
    p.release(1)
    p.release(1)  # idempotent
    assert p.gauges()["spec_decode_eagle_cache_sequences"] == 1


def test_a_round_s_sequences_draft_as_they_would_alone(eagle_dir):
    p = EagleProposer.from_config(_settings(eagle_dir), {})
    g = torch.Generator().manual_seed(1)
    reqs = [ProposalRequest(s, torch.randint(0, 97, (5 + 3 * s,), generator=g).tolist(), 1 + s % 4,
                            SamplingParams() if s % 2 else SamplingParams(temperature=1.0, seed=s), 0,
                            torch.randn(1 + s, 32, generator=g)) for s in range(6)]
    together = p.propose(reqs)
    for r, t in zip(reqs, together):
        alone = EagleProposer.from_config(_settings(eagle_dir), {}).propose([r])[0]
        assert t.draft_token_ids.tolist() == alone.draft_token_ids.tolist() and len(t.draft_token_ids) == r.k
        torch.testing.assert_close(t.draft_probs, alone.draft_probs, atol=1e-5, rtol=1e-4)
    assert p.propose([ProposalRequest(9, [4, 8], 3, SamplingParams(), 0, None)])[0].draft_token_ids.numel() == 0
    probs = together[3].draft_probs
    assert probs.shape == (4, 97) and torch.allclose(probs.sum(-1), torch.ones(4))
    assert (probs[:, [t for t in range(97) if t not in KEPT]] == 0).all()


def test_the_training_unroll_is_what_drafting_computes(tiny_lm):
    """unrolled_outputs' step d at pair j is the output live drafting has at its (d+1)-th draft when the context held
    the target's pairs up to j - d and the drafts were the true tokens (EAGLE-3's training-time test)."""
    model, vocab = _head(tiny_lm)
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(0, 97, (14,), generator=g).tolist()
    f = torch.randn(13, 32, generator=g)
    tokens = torch.tensor(vocab.map_ids(ids[1:]))[None]  # pair j's token x_{j+1}
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
                torch.testing.assert_close(outs[d][0, j : j + 1], a, atol=1e-5, rtol=1e-4)


def test_a_step_drafts_while_its_confidence_holds_and_scores_its_drafts(eagle_dir):
    """With min_token_prob = t, each proposal is the prefix of the every-slot proposal up to the first slot i where
    (product of the drafts' probabilities before i) x (slot i's top probability) < t; its score is the sum of its
    drafts' running probabilities (greedy and sampled rows alike)."""
    hidden = torch.randn(40, 32) * 3
    reqs = [ProposalRequest(i, [4, 8], 3, SamplingParams() if i % 2 else SamplingParams(temperature=1.0, seed=i), 0,
                            hidden[i : i + 1]) for i in range(40)]
    every = EagleProposer.from_config(_settings(eagle_dir), {}).propose(reqs)
    running, confidence = confidence_rule(every)
    t = float(torch.stack([c[0] for c in confidence]).median())  # about half the rows draft nothing
    cut = EagleProposer.from_config(_settings(eagle_dir, t), {}).propose(reqs)
    lengths = assert_cut_by_rule(every, cut, running, confidence, t)
    assert 0 in lengths and max(lengths) > 0  # the rule cut some rows, not all
    with pytest.raises(Exception, match="eagle_min_token_prob"):
        EagleSettings(eagle_min_token_prob=1.5)


def test_sampled_drafts_come_from_the_distributions_they_return(eagle_dir):
    """The first draft's frequencies over 4000 seeds match its draft_probs (chi-square): rejection sampling, exact
    for any q it is given with its drafts, then keeps the target's law."""
    p = EagleProposer.from_config(_settings(eagle_dir), {})
    hidden = torch.randn(1, 32) * 3
    reqs = [ProposalRequest(i, [4, 8], 1, SamplingParams(temperature=1.0, seed=i), 0, hidden) for i in range(4000)]
    out = p.propose(reqs)
    q = out[0].draft_probs[0].double()
    assert all(torch.allclose(o.draft_probs[0].double(), q) for o in out[:50])  # the same state: the same q
    counts = np.bincount([int(o.draft_token_ids[0]) for o in out], minlength=97)
    support = q.numpy() > 1e-3
    assert counts[~support].sum() <= 5
    assert chisquare(counts[support], q.numpy()[support] / q.numpy()[support].sum() * counts[support].sum()).pvalue \
        > 1e-3


# 0: every slot. 0.00046 sits among the untrained tiny head's (near-uniform) confidences at the second slot, so whether
# a step drafts it depends on the first sampled draft: the law must hold under that stopping rule too.
@pytest.mark.parametrize("min_token_prob", [0.0, 0.00046])
def test_through_the_served_backends_greedy_output_is_the_target_s_and_sampled_output_its_law(
        eagle_dir, tiny_dir, tiny_lm, real_tokenizer, min_token_prob):
    from spec_decode.generation import Generation
    from spec_decode.request import GenerationRequest
    from spec_decode.serving.draft_model import DraftBackend
    from spec_decode.serving.local_ensemble import LocalEnsemble
    from spec_decode.serving.target_model import TargetBackend
    from spec_decode.serving.verifier_model import VerifierBackend

    ens = LocalEnsemble(DraftBackend({"draft_model_path": "", "suffix_backend": "python", "device": "cpu",
                                      "eagle_path": str(eagle_dir), "eagle_min_token_prob": str(min_token_prob)}),
                        TargetBackend({"model_path": str(tiny_dir), "device": "cpu"}),
                        VerifierBackend({"backend": "torch", "num_threads": "0"}))

    def run(seq, prompt, n, **kw):
        req = GenerationRequest("x", n, speculative_method="eagle", num_draft_tokens=3, **kw)
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
    n = 1500
    gens = [run(100 + s, prompt, 2, temperature=1.0, random_seed=s) for s in range(n)]
    counts = np.bincount([g.output_ids[1] for g in gens], minlength=97)
    drafted = {g.stats.draft_tokens for g in gens}  # the second step's drafts: 3 each, or fewer where the rule cut
    assert drafted == {3} if min_token_prob == 0 else len(drafted) > 1, drafted
    big = marginal * n >= 5  # the rest pooled into one bin
    observed, expected = counts[big], marginal[big] * n
    if (~big).any():
        observed, expected = np.append(observed, counts[~big].sum()), np.append(expected, marginal[~big].sum() * n)
    assert chisquare(observed, expected * observed.sum() / expected.sum()).pvalue > 1e-3, (counts, marginal)


def test_hidden_states_of_another_shape_or_not_finite_are_refused_naming_the_input_and_long_ones_draft_less(
        eagle_dir):
    p = EagleProposer.from_config(_settings(eagle_dir), {})
    p.check(ProposalRequest(1, [4, 5, 6, 7], 2, SamplingParams(), 0, torch.randn(3, 32)))
    fits = ProposalRequest(1, [4] * 1020, 4, SamplingParams(), 0, torch.randn(3, 32))  # 1,024 positions: the target's
    p.check(fits)
    assert p.room(fits) == 4
    past = ProposalRequest(1, [4] * 1021, 4, SamplingParams(), 0, torch.randn(3, 32))
    p.check(past)  # not refused: it drafts what fits (tests/unit/proposers/test_short_context.py)
    assert p.room(past) == 3
    p.check(ProposalRequest(1, [4], 2, SamplingParams(), 0, None))  # none yet: no drafts, no error
    with pytest.raises(ValueError, match=r"context_hidden_states.*\[m, 32\].*\[2, 31\]"):
        p.check(ProposalRequest(1, [4, 5, 6], 2, SamplingParams(), 0, torch.randn(2, 31)))
    with pytest.raises(ValueError, match=r"context_hidden_states.*m < 3.*\[3, 32\]"):  # a state for the last token too
        p.check(ProposalRequest(1, [4, 5, 6], 2, SamplingParams(), 0, torch.randn(3, 32)))
    with pytest.raises(ValueError, match="context_hidden_states.*finite"):
        p.check(ProposalRequest(1, [4, 5], 2, SamplingParams(), 0, torch.full((1, 32), float("nan"))))
