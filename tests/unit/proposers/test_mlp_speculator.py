"""spec_decode.proposers.mlp_speculator: the speculator's stages, its folder, and its drafts (greedy and sampled:
the distributions it returns are the ones it sampled from), and the target's own output through the served backends
with it."""

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from spec_decode.draft_vocab import DraftVocab
from spec_decode.proposers import MLPSpeculator, MLPSpeculatorProposer, MLPSpeculatorSettings, ProposalRequest
from spec_decode.proposers.mlp_speculator import resolve_speculator_path
from spec_decode.sampling import SamplingParams
from tests.helpers import save_tiny_speculator

KEPT = list(range(0, 97, 2))  # 49 of the tiny target's 97 tokens


def _speculator(tiny_lm, n_predict=3, seed=0):
    torch.manual_seed(seed)
    vocab = DraftVocab(KEPT, 97)
    emb = tiny_lm.get_input_embeddings().weight.detach()[vocab.token_ids]
    head = tiny_lm.get_output_embeddings().weight.detach()[vocab.token_ids]
    return MLPSpeculator(torch.cat([emb, emb.mean(0, keepdim=True)]), head, n_predict), vocab


def _every_slot(folder, min_token_prob=0.0):
    return MLPSpeculatorSettings(mlp_speculator_path=str(folder), mlp_speculator_min_token_prob=min_token_prob)


@pytest.fixture
def speculator_dir(tiny_lm, tmp_path):
    return save_tiny_speculator(tiny_lm, tmp_path / "spec", KEPT)


def test_the_folder_round_trips_and_the_path_resolves(speculator_dir, tiny_lm):
    model, vocab = MLPSpeculator.load(speculator_dir)
    ref, _ = _speculator(tiny_lm)
    hidden, tokens = torch.randn(5, 32), torch.randint(0, len(KEPT) + 1, (5, 3))
    torch.testing.assert_close(model(hidden, tokens), ref(hidden, tokens))
    assert model(hidden, tokens).shape == (5, 3, len(KEPT)) and vocab.token_ids.tolist() == KEPT
    assert resolve_speculator_path(str(speculator_dir)) == speculator_dir and resolve_speculator_path("") is None
    assert MLPSpeculatorProposer.configured(MLPSpeculatorSettings(mlp_speculator_path=str(speculator_dir)))
    assert not MLPSpeculatorProposer.configured(MLPSpeculatorSettings(mlp_speculator_path=str(speculator_dir / "x")))
    with pytest.raises(FileNotFoundError):
        resolve_speculator_path(str(speculator_dir / "x"))


def test_greedy_drafts_follow_the_stages_argmax_chain_from_the_last_hidden_state(speculator_dir):
    p = MLPSpeculatorProposer.from_config(_every_slot(speculator_dir), {})
    hidden = torch.randn(2, 32)
    reqs = [ProposalRequest(1, [4, 8], 4, SamplingParams(), 0, hidden),
            ProposalRequest(2, [6], 2, SamplingParams(), 0, hidden[:1] * 2),
            ProposalRequest(3, [6], 2, SamplingParams(), 0, None)]
    out = p.propose(reqs)
    state, tok, chain = hidden[-1:], torch.tensor([p.vocab.map_ids([8])[0]]), []
    for i in range(3):  # n_predict = 3 < k = 4
        state, logits = p.model.stage(i, state, tok)
        tok = logits.argmax(-1)
        chain.append(KEPT[int(tok)])
    assert out[0].draft_token_ids.tolist() == chain
    assert len(out[1].draft_token_ids) == 2 and out[2].draft_token_ids.numel() == 0  # no hidden state: no drafts
    probs = out[0].draft_probs
    assert probs.shape == (3, 97) and torch.allclose(probs.sum(-1), torch.ones(3))
    assert (probs[:, [t for t in range(97) if t not in KEPT]] == 0).all()


def test_a_step_drafts_while_its_confidence_holds_and_scores_its_drafts(speculator_dir):
    """With min_token_prob = t, each proposal is the prefix of the every-slot proposal up to the first slot i where
    (product of the drafts' probabilities before i) x (slot i's top probability) < t; its score is the sum of its
    drafts' running probabilities (greedy and sampled rows alike)."""
    hidden = torch.randn(40, 32) * 3
    reqs = [ProposalRequest(i, [4, 8], 3, SamplingParams() if i % 2 else SamplingParams(temperature=1.0, seed=i), 0,
                            hidden[i : i + 1]) for i in range(40)]
    every = MLPSpeculatorProposer.from_config(_every_slot(speculator_dir), {}).propose(reqs)
    running, confidence = [], []
    for p in every:
        chosen = p.draft_probs[torch.arange(len(p.draft_token_ids)), p.draft_token_ids].double()
        running.append(torch.cumprod(chosen, 0))
        confidence.append(torch.cat([torch.ones(1, dtype=torch.float64), running[-1][:-1]])
                          * p.draft_probs.double().max(-1).values)
        assert p.score == pytest.approx(float(running[-1].sum()), rel=1e-5)
    t = float(torch.stack([c[0] for c in confidence]).median())  # about half the rows draft nothing
    cut = MLPSpeculatorProposer.from_config(_every_slot(speculator_dir, t), {}).propose(reqs)
    lengths = []
    for p, q, run, conf in zip(every, cut, running, confidence):
        n = int((conf >= t).cumprod(0).sum())
        lengths.append(n)
        assert q.draft_token_ids.tolist() == p.draft_token_ids[:n].tolist()
        if n:
            torch.testing.assert_close(q.draft_probs, p.draft_probs[:n])
            assert q.score == pytest.approx(float(run[:n].sum()), rel=1e-5)
    assert 0 in lengths and max(lengths) > 0  # the rule cut some rows, not all
    with pytest.raises(Exception, match="mlp_speculator_min_token_prob"):
        MLPSpeculatorSettings(mlp_speculator_min_token_prob=1.5)


def test_sampled_drafts_come_from_the_distributions_they_return(speculator_dir):
    """The first draft's frequencies over 4000 seeds match its draft_probs (chi-square): rejection sampling, exact
    for any q it is given with its drafts, then keeps the target's law."""
    p = MLPSpeculatorProposer.from_config(_every_slot(speculator_dir), {})
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


# 0: every slot. 0.0006 sits among the untrained tiny speculator's (near-uniform) confidences at the second slot, so
# whether a step drafts it depends on the first sampled draft: the law must hold under that stopping rule too.
@pytest.mark.parametrize("min_token_prob", [0.0, 0.0006])
def test_through_the_served_backends_greedy_output_is_the_target_s_and_sampled_output_its_law(
        speculator_dir, tiny_dir, tiny_lm, real_tokenizer, min_token_prob):
    from spec_decode.generation import Generation
    from spec_decode.request import GenerationRequest
    from spec_decode.serving.draft_model import DraftBackend
    from spec_decode.serving.local_ensemble import LocalEnsemble
    from spec_decode.serving.target_model import TargetBackend
    from spec_decode.serving.verifier_model import VerifierBackend

    ens = LocalEnsemble(DraftBackend({"draft_model_path": "", "suffix_backend": "python", "device": "cpu",
                                      "mlp_speculator_path": str(speculator_dir),
                                      "mlp_speculator_min_token_prob": str(min_token_prob)}),
                        TargetBackend({"model_path": str(tiny_dir), "device": "cpu"}),
                        VerifierBackend({"backend": "torch", "num_threads": "0"}))

    def run(seq, prompt, n, **kw):
        req = GenerationRequest("x", n, speculative_method="mlp_speculator", num_draft_tokens=3, **kw)
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


def test_hidden_states_of_another_width_or_not_finite_are_refused_naming_the_input(speculator_dir):
    p = MLPSpeculatorProposer.from_config(_every_slot(speculator_dir), {})
    p.check(ProposalRequest(1, [4], 2, SamplingParams(), 0, torch.randn(3, 32)))
    p.check(ProposalRequest(1, [4], 2, SamplingParams(), 0, None))  # none yet: no drafts, no error
    with pytest.raises(ValueError, match=r"context_hidden_states.*\[m, 32\].*\[2, 31\]"):
        p.check(ProposalRequest(1, [4], 2, SamplingParams(), 0, torch.randn(2, 31)))
    with pytest.raises(ValueError, match="context_hidden_states.*finite"):
        p.check(ProposalRequest(1, [4], 2, SamplingParams(), 0, torch.full((1, 32), float("nan"))))
