"""spec_decode.proposers.speculators.arctic: Arctic Inference's MLP and LSTM speculators loaded as ArcticTraining
saves them, their logits against hand-written ArcticTraining forwards (the LSTM gate by gate, with its four
projections apart), batched drafts (greedy and sampled: the distributions returned are those drawn from), k capped at
n_predict, processors applied, and load errors (sizes, weights, base_model_archs) naming file and key."""

import json
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from scipy.stats import chisquare

from spec_decode.processors import ProcessorSpec
from spec_decode.proposers.base import ProposalRequest
from spec_decode.proposers.speculators import SpeculatorLoadError, SpeculatorSettings, TargetInfo
from spec_decode.proposers.speculators.arctic import ArcticLSTMHead, ArcticProposer, load_arctic
from spec_decode.proposers.speculators.checkpoint import find_weights, load_weights
from spec_decode.proposers.speculators.layouts import detect
from spec_decode.proposers.speculators.mlp import MLPSpeculatorHead
from spec_decode.sampling import SamplingParams
from tests.helpers import assert_batched_as_alone, head_round
from tests.speculator_checkpoints.arctic import write_arctic

H, V = 32, 97  # the tiny target's hidden size and vocabulary

VARIANTS = {
    "mlp": {"kind": "mlp"},
    "mlp-untied-unscaled-safetensors": {"kind": "mlp", "tie_weights": False, "scale_input": False, "inner_dim": 24,
                                        "weights_format": "safetensors"},
    "lstm": {"kind": "lstm"},
    "lstm-four-embeddings-unscaled": {"kind": "lstm", "tie_lstm_embs": False, "scale_input": False, "inner_dim": 24,
                                      "n_predict": 4},
    "lstm-one-head": {"kind": "lstm", "n_predict": 1, "weights_format": "safetensors"},
    "lstm-sum-rnn": {"kind": "lstm", "method": "sum_rnn", "inner_dim": 40},
    "lstm-sum-rnn-untied": {"kind": "lstm", "method": "sum_rnn", "tie_weights": False, "scale_input": False},
}


@pytest.fixture
def target(tiny_lm, tiny_dir):
    """The tiny target (saving it as tiny_dir recorded its architectures in its config)."""
    info = TargetInfo.from_model(tiny_lm)
    assert info.architectures == ("LlamaForCausalLM",)
    return info


def _settings(folder, tiny_dir, min_token_prob=0.0):
    return SpeculatorSettings(speculator_path=str(folder), target_model_path=str(tiny_dir),
                              speculator_min_token_prob=min_token_prob)


def _ln(x, w=None, b=None):
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
    return x if w is None else x * w + b


@torch.no_grad()
def reference(folder, states, tokens):
    """ArcticTraining's speculator forward at one position, in float64, from the folder's files: state [B, H],
    tokens [B, n] (head i's input token) -> logits [B, n, V]. The MLP as ``MLPSpeculator.forward``, the LSTM class
    as ``ArcticLSTMSpeculator.forward`` (``sum_rnn``, or ``sum_lstm`` gate by gate)."""
    cfg = json.loads((folder / "config.json").read_text())
    sd = {k.removeprefix("speculator."): v.double() for k, v in load_weights(find_weights(folder)).items()}
    n, tie = cfg["n_predict"], cfg["tie_weights"]
    lstm = cfg["architectures"] == ["ArcticLSTMSpeculatorPreTrainedModel"]
    inner = int(cfg["inner_dim"]) or cfg["emb_dim"]
    seq = ".0" if lstm else ""  # the LSTM class's sum_rnn stages are nn.Sequential
    state_weight = 0.5 ** (0.5 / n)
    alpha = math.sqrt((1 - state_weight**2) * inner / 2) / state_weight
    state = states.double()
    if cfg["scale_input"]:
        state = _ln(state) / 2**0.5
    cell = torch.zeros(len(state), inner, dtype=torch.float64)
    out = []
    for i in range(tokens.shape[1]):
        e, p = (0, 1 if i >= 2 else i) if tie else (i, i)
        tok = tokens[:, i]
        if cfg.get("method") == "sum_lstm":
            pre = {g: state @ sd[f"{g}_proj.{p}.weight"].T  # each gate: its projection, its embedding (tied: one)
                      + alpha * sd[f"{'forget' if cfg['tie_lstm_embs'] else g}_emb.{e}.weight"][tok]
                   for g in ("forget", "input", "output", "cell")}
            forget, inp, output = (torch.sigmoid(pre[g]) for g in ("forget", "input", "output"))
            candidate = F.gelu(_ln(pre["cell"], sd["cell_ln.0.weight"], sd["cell_ln.0.bias"])) * inp
            cell = cell * forget + candidate
            state = F.gelu(_ln(cell, sd["state_ln.0.weight"], sd["state_ln.0.bias"])) * output
        else:
            state = state @ sd[f"proj.{p}{seq}.weight"].T + alpha * sd[f"emb.{e}{seq}.weight"][tok]
            state = F.gelu(_ln(state, sd[f"ln.{e}{seq}.weight"], sd[f"ln.{e}{seq}.bias"]))
        out.append(state @ sd[f"head.{0 if tie else i}.weight"].T)
    return torch.stack(out, 1)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_each_variant_is_detected_and_its_logits_follow_arctic_training_s_maths(tmp_path, target, variant):
    kw = dict(VARIANTS[variant])
    folder = write_arctic(tmp_path / variant, H, V, seed=5, **kw)
    assert detect(folder) == "arctic"
    head = load_arctic(folder, target)
    assert isinstance(head, ArcticLSTMHead if kw["kind"] == "lstm" and "method" not in kw else MLPSpeculatorHead)
    n = head.n_predict
    g = torch.Generator().manual_seed(0)
    states, tokens = torch.randn(5, H, generator=g) * 3, torch.randint(0, V, (5, n), generator=g)
    got = head(states, tokens)
    assert got.shape == (5, n, V)
    torch.testing.assert_close(got.double(), reference(folder, states, tokens), atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("kind", ["mlp", "lstm"])
def test_a_round_drafts_as_each_request_alone_with_k_capped_and_the_law_of_its_draft_probs(tmp_path, tiny_dir, kind):
    """Batched drafts equal per-request drafts; k is capped at n_predict (3); each row is the head's distribution
    given the earlier drafts; the first sampled draft's frequencies over 3000 seeds match its draft_probs."""
    folder = write_arctic(tmp_path / kind, H, V, kind=kind)
    p = ArcticProposer.from_config(_settings(folder, tiny_dir), {})
    assert isinstance(p, ArcticProposer) and p.name == "arctic"
    reqs = head_round(H, V, temperature=0.8)
    for r, t in zip(reqs, assert_batched_as_alone(p, reqs)):
        drafts = t.draft_token_ids.tolist()
        assert len(drafts) == min(r.k, 3)
        logits = reference(folder, r.hidden_states[-1:], torch.tensor([[r.token_ids[-1], *drafts[:-1]]]))[0]
        expected = torch.softmax(logits / (r.params.temperature or 1.0), -1)
        torch.testing.assert_close(t.draft_probs.double(), expected, atol=1e-5, rtol=1e-4)
        if r.params.is_greedy:
            assert drafts == expected.argmax(-1).tolist()
    hidden = reqs[0].hidden_states[-1:]
    out = p.propose([ProposalRequest(i, [5, 7], 1, SamplingParams(temperature=1.0, seed=i), 0, hidden)
                     for i in range(3000)])
    q = out[0].draft_probs[0].double().numpy()
    counts = np.bincount([int(o.draft_token_ids[0]) for o in out], minlength=V)
    support = q > 1e-3
    assert counts[~support].sum() <= 5
    assert chisquare(counts[support], q[support] / q[support].sum() * counts[support].sum()).pvalue > 1e-3


def test_processors_apply_a_forbidden_token_is_never_drafted(tmp_path, tiny_dir):
    p = ArcticProposer.from_config(_settings(write_arctic(tmp_path / "lstm", H, V, kind="lstm"), tiny_dir), {})
    hidden, ids = torch.randn(1, H, generator=torch.Generator().manual_seed(4)) * 3, [3, 1, 4]
    banned = int(p.propose_one(0, ids, 3, None, 0, hidden).draft_token_ids[1])
    spec = ProcessorSpec(prompt_len=len(ids), bad_words=((banned,),))
    for s in range(100):
        params = SamplingParams() if s == 0 else SamplingParams(temperature=1.5, seed=s)
        out = p.propose_one(s, ids, 3, params, 0, hidden, spec)
        assert banned not in out.draft_token_ids.tolist() and (out.draft_probs[:, banned] == 0).all()


def _drop(folder, key):
    file = folder / "pytorch_model.bin"
    state = torch.load(file, weights_only=True)
    del state[key]
    torch.save(state, file)


def test_load_errors_name_the_file_and_the_key(tmp_path, target, tiny_dir):
    cases = [
        (write_arctic(tmp_path / "archs", H, V, base_model_archs=["Qwen2ForCausalLM"]), "config.json",
         "base_model_archs"),
        (write_arctic(tmp_path / "archs-lstm", H, V, kind="lstm", base_model_archs=["GptOssForCausalLM"]),
         "config.json", "base_model_archs"),
        (write_arctic(tmp_path / "hidden", 48, V), "config.json", "emb_dim"),
        (write_arctic(tmp_path / "hidden-lstm", 48, V, kind="lstm"), "config.json", "input_hidden_dim"),
        (write_arctic(tmp_path / "vocab", H, 101, kind="lstm"), "config.json", "vocab_size"),
        (write_arctic(tmp_path / "stacked", H, V, kind="lstm", inner_dim=H, proj_dim="32.32"), "config.json",
         "proj_dim"),
        (write_arctic(tmp_path / "widths", H, V, kind="lstm", emb_dim="16"), "config.json", "emb_dim"),
        (write_arctic(tmp_path / "method", H, V, kind="lstm", method="sum_gru"), "config.json", "method"),
        (write_arctic(tmp_path / "untied", H, V, kind="lstm", tie_weights=False), "config.json", "tie_weights"),
    ]
    for kind, key in (("lstm", "forget_proj.1.weight"), ("lstm", "state_ln.0.bias"), ("mlp", "proj.0.weight")):
        folder = write_arctic(tmp_path / f"missing-{key}", H, V, kind=kind)
        _drop(folder, key)
        cases.append((folder, "pytorch_model.bin", key))
    for folder, file, key in cases:
        with pytest.raises(SpeculatorLoadError) as e:
            load_arctic(folder, target)
        assert e.value.file == str(folder / file) and e.value.key == key, (e.value, key)
        assert str(folder / file) in str(e.value) and repr(key) in str(e.value)
    with pytest.raises(SpeculatorLoadError, match="base_model_archs.*Qwen2ForCausalLM.*LlamaForCausalLM"):
        ArcticProposer.from_config(_settings(tmp_path / "archs", tiny_dir), {})
    # a tied stage whose first copy is gone loads from another (heads 1 and 2 share proj.1; torch.save keeps both)
    copies = write_arctic(tmp_path / "copies", H, V, kind="mlp", n_predict=3)
    _drop(copies, "proj.1.weight")
    torch.testing.assert_close(load_arctic(copies, target).proj[1], torch.load(
        copies / "pytorch_model.bin", weights_only=True)["proj.2.weight"])
    # a config without base_model_archs (as ArcticTraining writes it) is served: its sizes are still checked
    bare = write_arctic(tmp_path / "bare", H, V, kind="lstm")
    cfg = json.loads((bare / "config.json").read_text())
    del cfg["base_model_archs"]
    (bare / "config.json").write_text(json.dumps(cfg))
    assert isinstance(load_arctic(bare, target), ArcticLSTMHead)
