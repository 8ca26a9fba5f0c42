"""spec_decode.proposers.speculators.mlp: IBM's MLP speculator (MLPSpeculatorPreTrainedModel) loaded as fms-extras
publishes it (each variant: tied weights, scaled input, with or without the ``speculator.`` prefix, older configs),
its logits against a hand-written fms-extras forward, its batched drafts (greedy and sampled: the distributions it
returns are the ones it drew from), k capped at n_predict, processors applied, and load errors naming file and key."""

import json
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from scipy.stats import chisquare

from spec_decode.processors import ProcessorSpec
from spec_decode.proposers.base import ProposalRequest
from spec_decode.proposers.speculators import SpeculatorLoadError, SpeculatorSettings, TargetInfo
from spec_decode.proposers.speculators.checkpoint import find_weights, load_weights
from spec_decode.proposers.speculators.layouts import detect
from spec_decode.proposers.speculators.mlp import MLPSpeculatorProposer, load_mlp_speculator
from spec_decode.sampling import SamplingParams
from tests.helpers import assert_batched_as_alone, assert_cut_by_rule, confidence_rule, head_round
from tests.speculator_checkpoints.mlp import write_mlp_speculator

H, V = 32, 97  # the tiny target's hidden size and vocabulary

VARIANTS = {
    "published": {},
    "tied": {"tie_weights": True, "inner_dim": 24},
    "scaled": {"scale_input": True, "inner_dim": 48, "n_predict": 4},
    "tied-scaled-bare-bin": {"tie_weights": True, "scale_input": True, "prefix": False, "weights_format": "bin",
                             "n_predict": 4},
    "old-config": {"old_config": True, "inner_dim": 16},
    "one-head-bare": {"prefix": False, "n_predict": 1},
}


@pytest.fixture
def target(tiny_lm, tiny_dir):
    """The tiny target (saving it as tiny_dir recorded its architectures in its config)."""
    return TargetInfo.from_model(tiny_lm)


@pytest.fixture
def folder(tmp_path):
    return write_mlp_speculator(tmp_path / "mlp", H, V, inner_dim=24, tie_weights=True, scale_input=True)


def _settings(folder, tiny_dir, min_token_prob=0.0):
    return SpeculatorSettings(speculator_path=str(folder), target_model_path=str(tiny_dir),
                              speculator_min_token_prob=min_token_prob)


def _rms(x, w=None, b=None):
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
    return x if w is None else x * w + b


@torch.no_grad()
def reference(folder, states, tokens):
    """fms-extras ``MLPSpeculator.forward`` at one position, in float64, from the folder's files: state [B, H], tokens
    [B, n] (head i's input token) -> logits [B, n, V]. Tied stages read copy 0 (projections: 1 after head 0)."""
    cfg = json.loads((folder / "config.json").read_text())
    sd = {k.removeprefix("speculator."): v.double() for k, v in load_weights(find_weights(folder)).items()}
    n, inner = cfg["n_predict"], cfg["inner_dim"] or cfg["emb_dim"]
    tie = cfg.get("tie_weights", False)

    def w(stage, i, param="weight"):
        return sd[f"{stage}.{(min(i, 1) if stage == 'proj' else 0) if tie else i}.{param}"]

    state_weight = 0.5 ** (0.5 / n)
    emb_weight = math.sqrt(1 - state_weight**2)
    state = states.double()
    if cfg.get("scale_input", False):
        state = _rms(state) / 2**0.5
    out = []
    for i in range(tokens.shape[1]):
        z = w("emb", i)[tokens[:, i]] * (emb_weight * math.sqrt(inner / 2))
        state = state @ w("proj", i).T * state_weight + z
        state = F.gelu(_rms(state, w("ln", i), w("ln", i, "bias")))
        out.append(state @ w("head", i).T)
    return torch.stack(out, 1)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_each_published_variant_is_detected_and_its_logits_follow_the_fms_extras_maths(tmp_path, target, variant):
    folder = write_mlp_speculator(tmp_path / variant, H, V, seed=3, **VARIANTS[variant])
    assert detect(folder) == "mlp_speculator"
    head = load_mlp_speculator(folder, target)
    n = head.n_predict
    g = torch.Generator().manual_seed(0)
    states, tokens = torch.randn(5, H, generator=g) * 3, torch.randint(0, V, (5, n), generator=g)
    got = head(states, tokens)
    assert got.shape == (5, n, V) and got.dtype == torch.float32
    torch.testing.assert_close(got.double(), reference(folder, states, tokens), atol=2e-5, rtol=1e-4)
    weights = load_weights(find_weights(folder))
    if VARIANTS[variant].get("tie_weights") and VARIANTS[variant].get("weights_format") != "bin":
        assert "speculator.emb.1.weight" not in weights  # save_pretrained keeps each tied tensor once
    if VARIANTS[variant].get("old_config"):
        assert "tie_weights" not in json.loads((folder / "config.json").read_text())


def test_a_round_drafts_as_each_request_alone_from_its_last_state_and_token_with_k_capped(folder, tiny_dir):
    """Batched drafts equal per-request drafts; k is capped at n_predict (3); each draft row is the head's
    distribution given the previous drafts (greedy and sampled alike), starting from the last hidden state and the
    last committed token; a request without hidden states gets nothing."""
    p = MLPSpeculatorProposer.from_config(_settings(folder, tiny_dir), {})
    assert isinstance(p, MLPSpeculatorProposer) and p.name == "mlp_speculator"
    reqs = head_round(H, V, temperature=1.0)
    for r, t in zip(reqs, assert_batched_as_alone(p, reqs)):
        drafts = t.draft_token_ids.tolist()
        assert len(drafts) == min(r.k, 3) and t.draft_probs.shape == (len(drafts), V)
        tokens = torch.tensor([[r.token_ids[-1], *drafts[:-1]]])
        expected = torch.softmax(reference(folder, r.hidden_states[-1:], tokens)[0], -1)
        torch.testing.assert_close(t.draft_probs.double(), expected, atol=1e-5, rtol=1e-4)
        if r.params.is_greedy:
            assert drafts == expected.argmax(-1).tolist()
        assert t.score == pytest.approx(float(torch.cumprod(expected[range(len(drafts)), drafts], 0).sum()), rel=1e-4)


def test_sampled_drafts_come_from_the_distributions_they_return(folder, tiny_dir):
    """The first draft's frequencies over 4000 seeds match its draft_probs (chi-square)."""
    p = MLPSpeculatorProposer.from_config(_settings(folder, tiny_dir), {})
    hidden = torch.randn(1, H, generator=torch.Generator().manual_seed(2)) * 3
    out = p.propose([ProposalRequest(i, [5, 7], 1, SamplingParams(temperature=1.0, seed=i), 0, hidden)
                     for i in range(4000)])
    q = out[0].draft_probs[0].double()
    assert all(torch.allclose(o.draft_probs[0].double(), q) for o in out[:50])
    counts = np.bincount([int(o.draft_token_ids[0]) for o in out], minlength=V)
    support = q.numpy() > 1e-3
    assert counts[~support].sum() <= 5
    expected = q.numpy()[support] / q.numpy()[support].sum() * counts[support].sum()
    assert chisquare(counts[support], expected).pvalue > 1e-3


def test_a_step_drafts_while_its_confidence_holds(folder, tiny_dir):
    """With min_token_prob = t, each proposal is its every-slot proposal cut at the first slot whose confidence
    (product of the drafts' probabilities before it x its top probability) is below t."""
    hidden = torch.randn(40, H, generator=torch.Generator().manual_seed(3)) * 3
    reqs = [ProposalRequest(i, [4, 8], 3, SamplingParams() if i % 2 else SamplingParams(temperature=1.0, seed=i), 0,
                            hidden[i : i + 1]) for i in range(40)]
    every = MLPSpeculatorProposer.from_config(_settings(folder, tiny_dir), {}).propose(reqs)
    running, confidence = confidence_rule(every)
    t = float(torch.stack([c[1] for c in confidence]).median())  # about half the rows stop after one draft
    cut = MLPSpeculatorProposer.from_config(_settings(folder, tiny_dir, t), {}).propose(reqs)
    lengths = assert_cut_by_rule(every, cut, running, confidence, t)
    assert 1 in lengths and max(lengths) > 1


def test_processors_apply_a_forbidden_token_is_never_drafted(folder, tiny_dir):
    p = MLPSpeculatorProposer.from_config(_settings(folder, tiny_dir), {})
    hidden, ids = torch.randn(1, H, generator=torch.Generator().manual_seed(4)) * 3, [3, 1, 4]
    banned = int(p.propose_one(0, ids, 3, None, 0, hidden).draft_token_ids[0])
    spec = ProcessorSpec(prompt_len=len(ids), bad_words=((banned,),))
    for s in range(200):
        params = SamplingParams() if s == 0 else SamplingParams(temperature=1.5, seed=s)
        out = p.propose_one(s, ids, 3, params, 0, hidden, spec)
        assert banned not in out.draft_token_ids.tolist() and len(out.draft_token_ids) == 3
        assert (out.draft_probs[:, banned] == 0).all()


def _rewrite(folder, edit):
    file = folder / "model.safetensors"
    state = load_file(str(file))
    edit(state)
    save_file(state, str(file))
    return file


def test_load_errors_name_the_file_and_the_key(tmp_path, target, tiny_dir):
    cases = [
        (write_mlp_speculator(tmp_path / "hidden", 48, V), "config.json", "emb_dim"),
        (write_mlp_speculator(tmp_path / "vocab", H, 101), "config.json", "vocab_size"),
        (write_mlp_speculator(tmp_path / "n", H, V, n_predict=0), "config.json", "n_predict"),
        (write_mlp_speculator(tmp_path / "tie1", H, V, n_predict=1, tie_weights=True), "config.json", "tie_weights"),
    ]
    missing = write_mlp_speculator(tmp_path / "missing", H, V)
    _rewrite(missing, lambda s: s.pop("speculator.head.1.weight"))
    cases.append((missing, "model.safetensors", "speculator.head.1.weight"))
    shape = write_mlp_speculator(tmp_path / "shape", H, V, inner_dim=24)
    _rewrite(shape, lambda s: s.update({"speculator.proj.0.weight": torch.zeros(24, 48)}))
    cases.append((shape, "model.safetensors", "speculator.proj.0.weight"))
    tied = write_mlp_speculator(tmp_path / "tied", H, V, tie_weights=True, prefix=False)
    _rewrite(tied, lambda s: s.pop("proj.1.weight"))  # heads 1 and 2 share it: saved once, and here not at all
    cases.append((tied, "model.safetensors", "proj.1.weight"))
    for folder, file, key in cases:
        with pytest.raises(SpeculatorLoadError) as e:
            load_mlp_speculator(folder, target)
        assert e.value.file == str(folder / file) and e.value.key == key
        assert str(folder / file) in str(e.value) and repr(key) in str(e.value)
    with pytest.raises(SpeculatorLoadError, match="emb_dim"):
        MLPSpeculatorProposer.from_config(_settings(tmp_path / "hidden", tiny_dir), {})
    assert "48" in str(pytest.raises(SpeculatorLoadError, load_mlp_speculator, tmp_path / "hidden", target).value)


# -- candidate trees (speculators/candidate_tree.py) ----------------------------------------------------------------


def test_select_nodes_keeps_the_most_probable_closed_under_parents_ordered_by_depth():
    from spec_decode.proposers.speculators.candidate_tree import Candidate, select_nodes

    # the third: a sure child, tied with its parent (the shallower goes first)
    cands = [Candidate(-1, 5, 0.6, 1), Candidate(-1, 7, 0.3, 1), Candidate(0, 9, 0.6, 2),
             Candidate(0, 4, 0.2, 2), Candidate(1, 8, 0.25, 2), Candidate(2, 1, 0.5, 3)]
    tokens, parents, score = select_nodes(cands, 4)
    assert tokens == [5, 7, 9, 1] and parents == [-1, -1, 0, 2] and score == pytest.approx(0.6 + 0.3 + 0.6 + 0.5)
    assert select_nodes(cands, 1) == ([5], [-1], pytest.approx(0.6))


@pytest.mark.parametrize(("k", "min_prob"), [(8, 0.0), (3, 0.0), (8, 0.02)])
def test_a_tree_request_gets_the_heads_top_k_expanded_and_reranked(folder, tiny_dir, k, min_prob):
    """draft_tree: a tree of at most k nodes, no draft_probs; every node's token is among the tree_top_k most probable
    of its head position's distribution given its own path (the reference maths), every node's joint probability passes
    the threshold, and the score is the sum of the nodes' joint probabilities."""
    from spec_decode.tree import check_tree, path_tokens

    p = MLPSpeculatorProposer.from_config(_settings(folder, tiny_dir, min_prob), {})
    g = torch.Generator().manual_seed(k)
    states = torch.randn(3, H, generator=g) * 2
    ids = [5, 9, 11, 3]
    (tree,) = p.propose([ProposalRequest(1, ids, k, SamplingParams(), 0, states, tree=True)])
    drafts = tree.draft_token_ids.tolist()
    parents = tree.draft_parents.tolist() if tree.draft_parents is not None else list(range(-1, len(drafts) - 1))
    assert tree.draft_probs is None and 0 < len(drafts) <= k
    check_tree(drafts, parents)
    joints = []
    for node, path in enumerate(path_tokens(drafts, parents)[1:]):
        assert len(path) <= 3  # n_predict
        dist = torch.softmax(reference(folder, states[-1:], torch.tensor([[ids[-1], *path[:-1]]]))[0], -1)
        top = torch.topk(dist[len(path) - 1], p.tree_top_k).indices.tolist()
        assert path[-1] in top, (node, path)
        joints.append(float(torch.prod(dist[torch.arange(len(path)), path])))
    assert min(joints) >= min_prob and tree.score == pytest.approx(sum(joints), rel=1e-4)
    if min_prob == 0.0:  # 3 positions x 4 children expanded: k nodes to keep (the most probable: a random head's
        assert len(drafts) == k  # flat distributions keep shallow ones)


def test_a_request_s_tree_top_k_and_tree_depth_draft_the_tree_of_that_config(folder, tiny_dir):
    """A request's tree_top_k / tree_depth replace the config's tree_top_k / tree_depth for it alone."""
    from dataclasses import replace

    states = torch.randn(3, H, generator=torch.Generator().manual_seed(4)) * 2
    plain = ProposalRequest(1, [5, 9, 11, 3], 6, SamplingParams(), 0, states, tree=True)
    p = MLPSpeculatorProposer.from_config(_settings(folder, tiny_dir), {})
    mine, asked = p.propose([plain, replace(plain, seq_id=2, tree_top_k=2, tree_depth=2)])
    configured = MLPSpeculatorProposer.from_config(replace(_settings(folder, tiny_dir), tree_top_k=2, tree_depth=2),
                                                   {}).propose([plain])[0]
    assert asked.draft_token_ids.tolist() == configured.draft_token_ids.tolist()
    assert asked.draft_parents.tolist() == configured.draft_parents.tolist()
    assert mine.draft_token_ids.tolist() == p.propose([plain])[0].draft_token_ids.tolist()
    assert len(asked.draft_token_ids) == 4 and max(asked.draft_parents.tolist()) < 2  # 2 nodes per level, 2 levels
