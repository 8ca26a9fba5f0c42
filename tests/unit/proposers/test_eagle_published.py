"""Published EAGLE heads: EAGLE-1/2 (spec_decode.proposers.eagle.published.load_eagle1: the authors' layout and vLLM's
conversion) and EAGLE-3 (spec_decode.proposers.eagle.eagle3_published.load_eagle3: ``LlamaForCausalLMEagle3`` and the
authors' trainer's ``LlamaForCausalLM`` + ``draft_vocab_size``): detection, the loaded head's teacher-forced logits
against the published maths written here with plain torch ops straight from the raw weights, and each load error naming
the file and the key."""

import json
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from spec_decode.proposers.eagle import load_eagle1, load_eagle3
from spec_decode.proposers.speculators import (
    SpeculatorLoadError,
    TargetInfo,
    aux_hidden_state_layers,
    detect,
    eagle3_layer_ids,
    served_heads,
)
from tests.speculator_checkpoints.eagle import write_eagle1, write_eagle3

H, V, HEADS, KV, INTER, D = 32, 97, 4, 2, 64, 8  # the tiny targets' sizes (tests/conftest.py tiny_lm, deep_lm)
EPS = 1e-5  # the written heads' rms_norm_eps
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 64}  # with head_dim 8: one high, one medium and two low frequencies


# --- the published maths, from the raw weights (float64) -------------------------------------------------------------


def _raw(folder: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the head's weights file as written, float64 (integers as they are)."""
    (file,) = [p for p in folder.iterdir() if p.suffix in (".bin", ".safetensors")]
    if file.suffix == ".bin":
        state = torch.load(file, weights_only=True)
    else:
        from safetensors.torch import load_file

        state = load_file(str(file))
    return {k: v.double() if v.is_floating_point() else v for k, v in state.items()}


def _rms(x, w):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS) * w


def _inv_freq(theta=10000.0, scaling=None):
    """Llama's rotary frequencies [D / 2], and Llama 3.1's scaling of them (transformers'
    ``_compute_llama3_parameters``, rewritten)."""
    inv = 1.0 / theta ** (torch.arange(0, D, 2, dtype=torch.float64) / D)
    if not scaling:
        return inv
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    old = scaling["original_max_position_embeddings"]
    out = []
    for f in inv.tolist():
        wavelen = 2 * math.pi / f
        if wavelen < old / high:
            out.append(f)
        elif wavelen > old / low:
            out.append(f / factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append((1 - smooth) * f / factor + smooth * f)
    return torch.tensor(out, dtype=torch.float64)


def _linear(x, w, name):
    """x @ W^T, plus the bias when the weights have one (``<name>.bias``)."""
    y = x @ w[name + ".weight"].T
    return y + w[name + ".bias"] if name + ".bias" in w else y


def _attention(x, w, prefix, pos, inv):
    """Llama's self-attention of one sequence x [T, in] (causal, rotary positions ``pos``, grouped key/value heads of
    D dims, as many as the projections hold; Qwen2's q/k/v biases, Llama's ``attention_bias``, when the weights have
    them)."""
    t = x.shape[0]
    heads, kv = w[prefix + "q_proj.weight"].shape[0] // D, w[prefix + "k_proj.weight"].shape[0] // D
    q = _linear(x, w, prefix + "q_proj").view(t, heads, D)
    k = _linear(x, w, prefix + "k_proj").view(t, kv, D)
    v = _linear(x, w, prefix + "v_proj").view(t, kv, D)
    ang = pos.double()[:, None, None] * inv  # [T, 1, D/2]
    cos, sin = torch.cat([ang.cos(), ang.cos()], -1), torch.cat([ang.sin(), ang.sin()], -1)

    def rot(u):
        return u * cos + torch.cat([-u[..., D // 2 :], u[..., : D // 2]], -1) * sin

    q, k = rot(q), rot(k)
    k, v = k.repeat_interleave(heads // kv, 1), v.repeat_interleave(heads // kv, 1)
    scores = torch.einsum("thd,shd->hts", q, k) / math.sqrt(D)
    scores = scores.masked_fill(~torch.ones(t, t, dtype=torch.bool).tril(), float("-inf"))
    att = torch.einsum("hts,shd->thd", scores.softmax(-1), v).reshape(t, heads * D)
    return _linear(att, w, prefix + "o_proj")


def _mlp(x, w, prefix):
    return (F.silu(x @ w[prefix + "gate_proj.weight"].T) * (x @ w[prefix + "up_proj.weight"].T)) \
        @ w[prefix + "down_proj.weight"].T


def eagle1_reference(w, embedding, lm_head, hidden, tokens, pos, inv, prefix="layers.0."):
    """EAGLE-1 (SafeAILab/EAGLE ``model/cnets.py``, ``model/cnets1.py``): fc over [E(x_{j+1}); f_j] (+ bias), one
    Llama decoder layer without its input norm (q/k/v biases where the head has them: ``cnets1.py``'s
    ``qkv_bias``), the target's LM head on its output; logits [T, N]. HASS's ``add_para_norm`` (vLLM ``eagle.py``
    ``EAGLE.forward``): ``enorm`` on the embedding and ``hnorm`` on the hidden state before fc."""
    e = embedding[tokens]
    if "enorm.weight" in w:
        e, hidden = _rms(e, w["enorm.weight"]), _rms(hidden, w["hnorm.weight"])
    x = _linear(torch.cat([e, hidden], -1), w, "fc")
    h = x + _attention(x, w, prefix + "self_attn.", pos, inv)
    out = h + _mlp(_rms(h, w[prefix + "post_attention_layernorm.weight"]), w, prefix + "mlp.")
    return out @ lm_head.T


def eagle3_reference(w, embedding, aux, tokens, pos, inv, norm_before_residual=False, layer="midlayer."):
    """EAGLE-3 (SafeAILab/EAGLE ``eagle/traineagle3/cnets.py``, vLLM ``llama_eagle3.py``): g = fc [aux_1; aux_2;
    aux_3] (+ bias: the speculators library's ``Eagle3Speculator``), after an RMSNorm of the concatenation when the
    head has ``input_norm.weight`` (``norm_before_fc``, SGLang PR #32334); the layer attends over
    [input_layernorm(E(x_{j+1})); hidden_norm(g)] with residual g, or hidden_norm(g) with ``norm_before_residual``
    (vLLM ``_norm_before_residual``); MLP; final norm; lm_head over the draft vocabulary. Returns (logits [T, N], the
    target id of each draft index: i + d2t[i])."""
    x = torch.cat(aux, -1)
    if "input_norm.weight" in w:
        x = _rms(x, w["input_norm.weight"])
    g = _linear(x, w, "fc")
    normed = _rms(g, w[layer + "hidden_norm.weight"])
    u = torch.cat([_rms(embedding[tokens], w[layer + "input_layernorm.weight"]), normed], -1)
    h = (normed if norm_before_residual else g) + _attention(u, w, layer + "self_attn.", pos, inv)
    out = h + _mlp(_rms(h, w[layer + "post_attention_layernorm.weight"]), w, layer + "mlp.")
    logits = _rms(out, w["norm.weight"]) @ w["lm_head.weight"].T
    return logits, torch.arange(logits.shape[-1]) + w["d2t"]


def _teacher_forced(model, wire, tokens, pos):
    """The loaded head's logits [T, N] over one sequence of pairs (wire [T, H x (1 + A)] the target's hidden states as
    target_model returns them)."""
    with torch.no_grad():
        return model.logits(model(model.features(wire)[None], tokens[None], pos[None]))[0].double()


def _close(got, want):
    """float32 computation against the float64 reference: equal to a ten-thousandth of the logits' scale."""
    scale = float(want.abs().max())
    torch.testing.assert_close(got, want, atol=1e-4 * scale, rtol=1e-4)


def _sequence(seed, t=12):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, V, (t,), generator=g), torch.arange(3, 3 + t), g


@pytest.fixture(scope="module")
def target(tiny_dir):
    """The 2-layer tiny target as the loaders see it (sizes from its config.json, weights from its safetensors)."""
    return TargetInfo.from_folder(tiny_dir)


@pytest.fixture(scope="module")
def deep_target(deep_dir):
    return TargetInfo.from_folder(deep_dir)


def _edit(folder: Path, config=None, weights=None):
    """Change a written head: config keys (None: removed), and weights (a function of its state dict, in place)."""
    folder = Path(folder)
    if config:
        cfg = json.loads((folder / "config.json").read_text())
        for k, v in config.items():
            if v is None:
                cfg.pop(k, None)
            else:
                cfg[k] = v
        (folder / "config.json").write_text(json.dumps(cfg))
    if weights:
        (file,) = [p for p in folder.iterdir() if p.suffix in (".bin", ".safetensors")]
        if file.suffix == ".bin":
            state = torch.load(file, weights_only=True)
            weights(state)
            torch.save(state, file)
        else:
            from safetensors.torch import load_file, save_file

            state = load_file(str(file))
            weights(state)
            save_file({k: v.contiguous() for k, v in state.items()}, str(file))
    return folder


# --- EAGLE-1 ----------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("layout, fmt, bias, scaling", [
    ("authors", "bin", None, None),  # yuhuili/EAGLE-*: pytorch_model.bin, fc with its bias (the default)
    ("authors", "safetensors", False, None),  # "bias": false: no fc.bias
    ("authors", "bin", True, LLAMA3),  # a Llama 3.1 target's head: rope_scaling llama3
    ("vllm", "safetensors", None, None),  # vLLM's conversion: EAGLEModel, model.-prefixed, its own lm_head
    ("vllm", "bin", True, None),  # eagle_fc_bias: true
])
def test_an_eagle1_head_computes_the_published_maths(tiny_lm, target, tmp_path, layout, fmt, bias, scaling):
    emb = tiny_lm.get_input_embeddings().weight.detach()
    target_head = tiny_lm.get_output_embeddings().weight.detach().double()
    own_head = torch.randn(V, H, generator=torch.Generator().manual_seed(9))  # vLLM's layout carries its LM head
    config = {"rope_scaling": scaling} if scaling else {}
    folder = write_eagle1(tmp_path / "h", emb, HEADS, KV, INTER, layout=layout, fmt=fmt, bias=bias, seed=4,
                          lm_head=own_head, **config)
    assert detect(folder) == "eagle"
    model, vocab = load_eagle1(folder, target)
    assert vocab.token_ids.tolist() == list(range(V)) and vocab.target_vocab_size == V
    w = _raw(folder)
    assert ("fc.bias" in w) == (bias is not False if layout == "authors" else bool(bias))
    prefix = "model." if layout == "vllm" else ""
    lm_head = w["lm_head.weight"] if layout == "vllm" else target_head
    tokens, pos, g = _sequence(1)
    hidden = torch.randn(len(tokens), H, generator=g) * 2
    want = eagle1_reference(w, w[prefix + "embed_tokens.weight"], lm_head, hidden.double(), tokens, pos,
                            _inv_freq(scaling=scaling), prefix + "layers.0.")
    _close(_teacher_forced(model, hidden, tokens, pos), want)
    # the wire may carry auxiliary layers after the last hidden state (an EAGLE-3 head served beside it): not read
    wide = torch.cat([hidden, torch.randn(len(tokens), 2 * H, generator=g)], -1)
    torch.testing.assert_close(_teacher_forced(model, wide, tokens, pos), _teacher_forced(model, hidden, tokens, pos))
    if scaling:  # the scaling changes the maths: the plain frequencies do not match
        plain = eagle1_reference(w, w["embed_tokens.weight"], lm_head, hidden.double(), tokens, pos, _inv_freq())
        assert not torch.allclose(plain, want, atol=1e-3 * float(want.abs().max()))


def test_a_vllm_eagle1_head_with_a_truncated_vocabulary_drafts_over_its_token_map(tiny_lm, target, tmp_path):
    emb = tiny_lm.get_input_embeddings().weight.detach()
    token_map = torch.tensor(sorted(torch.randperm(V, generator=torch.Generator().manual_seed(3))[:40].tolist()))
    own_head = torch.randn(V, H, generator=torch.Generator().manual_seed(8))
    folder = write_eagle1(tmp_path / "h", emb, HEADS, KV, INTER, layout="vllm", fmt="safetensors", seed=6,
                          lm_head=own_head)

    def truncate(state):
        state["lm_head.weight"] = state["lm_head.weight"][token_map].contiguous()
        state["token_map"] = token_map

    _edit(folder, {"truncated_vocab_size": 40}, truncate)
    assert detect(folder) == "eagle"
    model, vocab = load_eagle1(folder, target)
    assert vocab.token_ids.tolist() == token_map.tolist()
    w = _raw(folder)
    tokens, pos, g = _sequence(2)
    hidden = torch.randn(len(tokens), H, generator=g) * 2
    want = eagle1_reference(w, w["model.embed_tokens.weight"], w["lm_head.weight"], hidden.double(), tokens, pos,
                            _inv_freq(), "model.layers.0.")
    got = _teacher_forced(model, hidden, tokens, pos)
    assert got.shape == (len(tokens), 40)
    _close(got, want)


@pytest.mark.parametrize("layout, variant", [
    ("authors", "qkv_bias"),  # yuhuili/EAGLE-Qwen2-*: "qkv_bias": true, q/k/v biases (cnets1.py)
    ("authors", "qwen2"),  # a head config that only says model_type qwen2 (Qwen2's attention has q/k/v biases)
    ("vllm", "attention_bias"),  # Llama's attention_bias: q/k/v and o biases
    ("vllm", "para_norm"),  # HASS: add_para_norm, enorm / hnorm before fc
    ("authors", "para_norm"),
    ("vllm_script", "fc_bias"),  # vLLM's conversion script: eagle_fc_bias under "model"
    ("vllm_script", "qkv_bias"),
    ("vllm", "full_lm_head"),  # a truncated vocabulary with the target's whole [V, H] lm_head (vLLM slices it)
])
def test_published_eagle1_variants_compute_their_authors_maths(tiny_lm, target, tmp_path, layout, variant):
    """Each variant real users download drafts from its authors' computation (none loads silently without its
    biases, norms or rows): the loaded head's teacher-forced logits against the reference from the raw weights."""
    emb = tiny_lm.get_input_embeddings().weight.detach()
    own_head = torch.randn(V, H, generator=torch.Generator().manual_seed(9))
    kw: dict = {}
    token_map = None
    if variant in ("qkv_bias", "attention_bias"):
        kw["qkv_bias"] = variant
    elif variant == "qwen2":
        kw["qkv_bias"] = "qkv_bias"
    elif variant == "para_norm":
        kw["para_norm"] = True
    elif variant == "fc_bias":
        kw["bias"] = True
    elif variant == "full_lm_head":
        token_map = torch.tensor(sorted(torch.randperm(V, generator=torch.Generator().manual_seed(3))[:40].tolist()))
        kw["token_map"] = token_map
    folder = write_eagle1(tmp_path / "h", emb, HEADS, KV, INTER, layout=layout, fmt="safetensors", seed=11,
                          lm_head=own_head, **kw)
    if variant == "qwen2":  # the key left out: model_type alone
        _edit(folder, {"qkv_bias": None, "model_type": "qwen2"})
    assert detect(folder) == "eagle"
    model, vocab = load_eagle1(folder, target)
    w = _raw(folder)
    prefix = "model." if layout == "vllm" else ""
    lm_head = w["lm_head.weight"] if layout != "authors" else tiny_lm.get_output_embeddings().weight.detach().double()
    if token_map is not None:
        assert lm_head.shape == (V, H) and vocab.token_ids.tolist() == token_map.tolist()
        lm_head = lm_head[token_map]
    tokens, pos, g = _sequence(5)
    hidden = torch.randn(len(tokens), H, generator=g) * 2
    want = eagle1_reference(w, w[prefix + "embed_tokens.weight"], lm_head, hidden.double(), tokens, pos, _inv_freq(),
                            prefix + "layers.0.")
    _close(_teacher_forced(model, hidden, tokens, pos), want)
    # the variant's weights matter: the plain computation (without them) is another one
    plain = {k: t for k, t in w.items() if not k.endswith(("_proj.bias", "norm.weight")) or "layernorm" in k}
    if variant != "full_lm_head":
        other = eagle1_reference(plain if variant != "fc_bias" else {k: t for k, t in w.items() if k != "fc.bias"},
                                 w[prefix + "embed_tokens.weight"], lm_head, hidden.double(), tokens, pos,
                                 _inv_freq(), prefix + "layers.0.")
        assert not torch.allclose(other, want, atol=1e-3 * float(want.abs().max()))


@pytest.mark.parametrize("variant, key", [
    ("qkv_bias", "layers.0.self_attn.k_proj.bias"),
    ("para_norm", "hnorm.weight"),
    ("fc_bias", "fc.bias"),
])
def test_an_eagle1_variant_missing_its_weights_is_refused_naming_it(tiny_lm, target, tmp_path, variant, key):
    """A config that names a variant whose weights the file lacks is refused at load, naming the weight."""
    kw = {"qkv_bias": dict(qkv_bias="qkv_bias"), "para_norm": dict(para_norm=True),
          "fc_bias": dict(layout="vllm_script", bias=True)}[variant]
    folder = _eagle1(tiny_lm, tmp_path / "h", drop=key, **kw)
    with pytest.raises(SpeculatorLoadError) as e:
        load_eagle1(folder, target)
    assert e.value.key == key


def _eagle1(tiny_lm, folder, **kw):
    return write_eagle1(folder, tiny_lm.get_input_embeddings().weight.detach(), HEADS, KV, INTER, **kw)


@pytest.mark.parametrize("case, file, key", [
    ("hidden_size", "config.json", "hidden_size"),
    ("vocab_size", "config.json", "vocab_size"),
    ("two layers", "config.json", "num_hidden_layers"),
    ("missing layer weight", "pytorch_model.bin", "layers.0.mlp.up_proj.weight"),
    ("missing fc bias", "pytorch_model.bin", "fc.bias"),
    ("MLP of another size", "pytorch_model.bin", "layers.0.mlp.gate_proj.weight"),
    ("embedding of another vocabulary", "pytorch_model.bin", "embed_tokens.weight"),
    ("yarn", "config.json", "rope_scaling"),
    ("truncated without token_map", "model.safetensors", "token_map"),
    ("token_map outside the vocabulary", "model.safetensors", "token_map"),
    ("output norm", "config.json", "skip_output_norm"),
])
def test_an_eagle1_head_that_does_not_fit_is_refused_naming_the_file_and_the_key(tiny_lm, target, tmp_path, case,
                                                                                  file, key):
    folder = tmp_path / "h"
    if case == "hidden_size":
        _eagle1(tiny_lm, folder, hidden_size=48)
    elif case == "vocab_size":
        _eagle1(tiny_lm, folder, vocab_size=100)
    elif case == "two layers":
        _eagle1(tiny_lm, folder, num_hidden_layers=2)
    elif case == "missing layer weight":
        _eagle1(tiny_lm, folder, drop="layers.0.mlp.up_proj.weight")
    elif case == "missing fc bias":
        _eagle1(tiny_lm, folder, drop="fc.bias")
    elif case == "MLP of another size":
        _eagle1(tiny_lm, folder, intermediate_size=128)
    elif case == "embedding of another vocabulary":
        _eagle1(tiny_lm, folder)
        _edit(folder, {"vocab_size": None}, lambda s: s.update({"embed_tokens.weight": s["embed_tokens.weight"][:90]}))
    elif case == "yarn":
        _eagle1(tiny_lm, folder, rope_scaling={"rope_type": "yarn", "factor": 4.0,
                                               "original_max_position_embeddings": 64})
    elif case.startswith("truncated") or case.startswith("token_map"):
        _eagle1(tiny_lm, folder, layout="vllm", fmt="safetensors")
        keep = torch.arange(40) * (3 if case.startswith("token_map") else 2)  # 3 x 39 = 117 >= 97

        def truncate(state):
            state["lm_head.weight"] = state["lm_head.weight"][:40].contiguous()
            if case.startswith("token_map"):
                state["token_map"] = keep

        _edit(folder, {"truncated_vocab_size": 40}, truncate)
    elif case == "output norm":
        _eagle1(tiny_lm, folder, layout="vllm", skip_output_norm=False)
    with pytest.raises(SpeculatorLoadError) as e:
        load_eagle1(folder, target)
    assert e.value.key == key and Path(e.value.file) == folder / file, (e.value.file, e.value.key)
    assert str(folder / file) in str(e.value) and repr(key) in str(e.value)


# --- EAGLE-3 ----------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("layout, fmt, layer_ids, embedded, scaling", [
    ("eagle3", "bin", [3, 4, 5], False, None),  # yuhuili/EAGLE3-*: the target's embedding shared
    ("trainer", "safetensors", [3, 4, 5], True, None),  # the trainer's LlamaForCausalLM + draft_vocab_size
    ("eagle3", "safetensors", None, True, LLAMA3),  # the default layers 2, L // 2, L - 3 = 2, 3, 3 of 6
    ("trainer", "bin", None, False, None),
])
def test_an_eagle3_head_computes_the_published_maths(deep_lm, deep_target, tmp_path, layout, fmt, layer_ids, embedded,
                                                     scaling):
    own = torch.randn(V, H, generator=torch.Generator().manual_seed(7))  # a copy of its own, when it has one
    config = {"rope_scaling": scaling} if scaling else {}
    folder = write_eagle3(tmp_path / "h", H, V, HEADS, KV, INTER, 48, layout=layout, fmt=fmt, seed=5,
                          layer_ids=layer_ids, embedding=own if embedded else None, **config)
    assert detect(folder) == "eagle3"
    ids = layer_ids or [2, 3, 3]
    assert eagle3_layer_ids(json.loads((folder / "config.json").read_text()), 6) == ids
    wire_layers = sorted(set(ids))
    model, vocab = load_eagle3(folder, deep_target)
    assert model.aux_columns == [1 + wire_layers.index(i) for i in ids]
    w = _raw(folder)
    assert ("embed_tokens.weight" in w) == embedded
    embedding = w["embed_tokens.weight"] if embedded else deep_lm.get_input_embeddings().weight.detach().double()
    tokens, pos, g = _sequence(3)
    states = {i: torch.randn(len(tokens), H, generator=g) for i in wire_layers}  # each layer's input, as if
    wire = torch.cat([torch.randn(len(tokens), H, generator=g)] + [states[i] for i in wire_layers], -1)
    want, draft_ids = eagle3_reference(w, embedding, [states[i].double() for i in ids], tokens, pos,
                                       _inv_freq(scaling=scaling))
    got = _teacher_forced(model, wire, tokens, pos)
    assert got.shape == (len(tokens), 48)
    _close(got, want)
    assert vocab.token_ids.tolist() == draft_ids.tolist() and vocab.target_vocab_size == V
    assert draft_ids.tolist() == list(range(0, 96, 2))  # write_eagle3: every other token
    # served beside other heads the wire may carry more layers: the head finds its own by their place
    wider = [0, *wire_layers, 5] if 5 not in wire_layers else [0, *wire_layers]
    model2, _ = load_eagle3(folder, deep_target, wider)
    extra = {i: states.get(i, torch.randn(len(tokens), H, generator=g)) for i in wider}
    wire2 = torch.cat([wire[:, :H]] + [extra[i] for i in wider], -1)
    torch.testing.assert_close(_teacher_forced(model2, wire2, tokens, pos), got)


@pytest.mark.parametrize("layout, variant", [
    ("eagle3", "norm_before_residual"),  # vLLM llama_eagle3.py: the residual is hidden_norm(g)
    ("eagle3", "norm_before_fc"),  # nvidia/gpt-oss-120b-Eagle3-v3: an RMSNorm over [aux_1; aux_2; aux_3] before fc
    ("eagle3", "attention_bias"),  # q/k/v/o biases
    ("eagle3", "target_hidden_size"),  # a head wider than the target: fc over 3 x the target's width
    ("speculators", "plain"),  # RedHatAI's: Eagle3Speculator, transformer_layer_config, layers.0.*, fc.bias
    ("speculators", "norm_before_residual"),
    ("speculators", "target_hidden_size"),
])
def test_published_eagle3_variants_compute_their_authors_maths(deep_lm, deep_target, tmp_path, layout, variant):
    """Each EAGLE-3 variant real users download drafts from its authors' computation: the loaded head's
    teacher-forced logits against the reference from the raw weights, and not the plain computation."""
    width = 48 if variant == "target_hidden_size" else H  # the head's own width (the target's is 32)
    heads = width // D
    own = torch.randn(V, width, generator=torch.Generator().manual_seed(7))
    kw = {variant: True} if variant in ("norm_before_residual", "norm_before_fc", "attention_bias") else {}
    if variant == "target_hidden_size":
        kw["target_hidden"] = H
    folder = write_eagle3(tmp_path / "h", width, V, heads, KV, INTER, 48, layout=layout, seed=12, layer_ids=[3, 4, 5],
                          embedding=own if layout == "speculators" or width != H else None, **kw)
    assert detect(folder) == "eagle3"
    model, vocab = load_eagle3(folder, deep_target)
    assert model.hidden_size == H  # the width of the wire's blocks: the target's
    w = _raw(folder)
    layer = "layers.0." if layout == "speculators" else "midlayer."
    embedding = w["embed_tokens.weight"] if "embed_tokens.weight" in w else \
        deep_lm.get_input_embeddings().weight.detach().double()
    tokens, pos, g = _sequence(4)
    states = {i: torch.randn(len(tokens), H, generator=g) for i in (3, 4, 5)}
    wire = torch.cat([torch.randn(len(tokens), H, generator=g)] + [states[i] for i in (3, 4, 5)], -1)
    aux = [states[i].double() for i in (3, 4, 5)]
    nbr = variant == "norm_before_residual"
    want, draft_ids = eagle3_reference(w, embedding, aux, tokens, pos, _inv_freq(), nbr, layer)
    _close(_teacher_forced(model, wire, tokens, pos), want)
    assert vocab.token_ids.tolist() == draft_ids.tolist()
    if variant != "plain" and variant != "target_hidden_size":  # without the variant: another computation
        plain = {k: t for k, t in w.items() if k != "input_norm.weight" and not k.endswith("_proj.bias")}
        other, _ = eagle3_reference(plain, embedding, aux, tokens, pos, _inv_freq(), False, layer)
        assert not torch.allclose(other, want, atol=1e-3 * float(want.abs().max()))


@pytest.mark.parametrize("ids, convention, served", [
    ([1, 3, 5], "output-of-layer (SpecForge: first id 1)", [2, 4, 6]),  # read as SGLang reads them (+1)
    ([2, 3, 5], "input-of-layer (vLLM, the EAGLE authors)", [2, 3, 5]),
    ([3, 4, 6], "input-of-layer naming layer L (gpt-oss-120b-Eagle3-v3's [24, 30, 36])", [3, 4, 6]),
])
def test_eagle3_layer_ids_follow_sglang_s_conventions(deep_target, tmp_path, ids, convention, served):
    """Explicit layer ids whose first is 1 name layers' outputs and are read one later (SGLang PR #25454); others are
    layer inputs; L (6 here) is the last layer's output. A head trained here names inputs whatever its first id."""
    folder = _eagle3(tmp_path / "h", layer_ids=ids)
    cfg = json.loads((folder / "config.json").read_text())
    assert eagle3_layer_ids(cfg, 6) == served, convention
    assert aux_hidden_state_layers(str(folder), 6) == sorted(set(served))
    model, _ = load_eagle3(folder, deep_target)
    assert model.aux_columns == [1 + sorted(set(served)).index(i) for i in served]
    ours = dict(cfg, spec_decode={"trained_by": "spec_decode.training.speculator"})
    assert eagle3_layer_ids(ours, 6) == ids


@pytest.mark.parametrize("case, key", [
    ("two layers", "num_hidden_layers"),
    ("fc_norm", "fc_norm"),
    ("norm_output", "norm_output"),
    ("norm_before_fc without its weight", "input_norm.weight"),
    ("narrower target without an embedding", "embed_tokens.weight"),
    ("target_hidden_size of another target", "target_hidden_size"),
    ("speculators: hidden_size of another target", "hidden_size"),
])
def test_an_eagle3_variant_not_served_is_refused_naming_the_key(deep_target, tmp_path, case, key):
    """A variant this head cannot compute, or one that does not fit the target, is refused at load naming the key
    (none loads silently wrong: a second layer, EAGLE 3.1's per-layer norms and norm_output are not implemented)."""
    folder = tmp_path / "h"
    if case == "two layers":
        _eagle3(folder, num_hidden_layers=2)
    elif case in ("fc_norm", "norm_output"):
        _eagle3(folder, **{case: True})
    elif case == "norm_before_fc without its weight":
        _eagle3(folder, norm_before_fc=True, drop="input_norm.weight")
    elif case == "narrower target without an embedding":
        write_eagle3(folder, 48, V, 6, KV, INTER, 48, layer_ids=[3, 4, 5], target_hidden=H)
    elif case == "target_hidden_size of another target":
        _eagle3(folder, target_hidden_size=64)
    else:
        write_eagle3(folder, 48, V, 6, KV, INTER, 48, layout="speculators", layer_ids=[3, 4, 5],
                     embedding=torch.randn(V, 48))
    with pytest.raises(SpeculatorLoadError) as e:
        load_eagle3(folder, deep_target)
    assert e.value.key == key, str(e.value)


def _eagle3(folder, **kw):
    kw.setdefault("layer_ids", [3, 4, 5])
    return write_eagle3(folder, kw.pop("hidden", H), V, HEADS, KV, INTER, 48, **kw)


@pytest.mark.parametrize("case, file, key", [
    ("hidden_size", "config.json", "hidden_size"),
    ("vocab_size", "config.json", "vocab_size"),
    ("missing norm", "pytorch_model.bin", "midlayer.hidden_norm.weight"),
    ("missing lm_head", "pytorch_model.bin", "lm_head.weight"),
    ("missing d2t", "pytorch_model.bin", "d2t"),
    ("d2t outside the vocabulary", "pytorch_model.bin", "d2t"),
    ("heads of another size", "pytorch_model.bin", "midlayer.self_attn.k_proj.weight"),
    ("embedding of another vocabulary", "pytorch_model.bin", "embed_tokens.weight"),
    ("layer ids beyond the target", "config.json", "eagle_aux_hidden_state_layer_ids"),
    ("default layer ids on 2 layers", "config.json", "eagle_aux_hidden_state_layer_ids"),
    ("yarn", "config.json", "rope_scaling"),
])
def test_an_eagle3_head_that_does_not_fit_is_refused_naming_the_file_and_the_key(deep_target, target, tmp_path, case,
                                                                                  file, key):
    folder, against = tmp_path / "h", deep_target
    if case == "hidden_size":
        _eagle3(folder, hidden=48)
    elif case == "vocab_size":
        _eagle3(folder, vocab_size=100)
    elif case == "missing norm":
        _eagle3(folder, drop="midlayer.hidden_norm.weight")
    elif case == "missing lm_head":
        _eagle3(folder, drop="lm_head.weight")
    elif case == "missing d2t":
        _eagle3(folder, drop="d2t")
    elif case == "d2t outside the vocabulary":
        _eagle3(folder)
        _edit(folder, weights=lambda s: s.update({"d2t": s["d2t"] * 3}))
    elif case == "heads of another size":
        _eagle3(folder, num_key_value_heads=4)
    elif case == "embedding of another vocabulary":
        _eagle3(folder, embedding=torch.randn(90, H))
    elif case == "layer ids beyond the target":
        _eagle3(folder, layer_ids=[3, 4, 7])
    elif case == "default layer ids on 2 layers":
        _eagle3(folder, layer_ids=None)
        against = target
    elif case == "yarn":
        _eagle3(folder, rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64})
    with pytest.raises(SpeculatorLoadError) as e:
        load_eagle3(folder, against)
    assert e.value.key == key and Path(e.value.file) == folder / file, (e.value.file, e.value.key)
    assert str(folder / file) in str(e.value) and repr(key) in str(e.value)


# --- detection, and the layers the target returns --------------------------------------------------------------------


def test_detection_names_the_method_or_refuses_an_unknown_layout(tiny_lm, tmp_path):
    from tests.speculator_checkpoints.medusa import write_medusa

    assert detect(_eagle1(tiny_lm, tmp_path / "a")) == "eagle"
    assert detect(_eagle1(tiny_lm, tmp_path / "b", layout="vllm")) == "eagle"
    assert detect(_eagle3(tmp_path / "c")) == "eagle3"
    assert detect(_eagle3(tmp_path / "d", layout="trainer")) == "eagle3"
    assert detect(write_medusa(tmp_path / "m", H, V)) == "medusa"
    tiny_lm.save_pretrained(tmp_path / "lm")  # a plain LM: two layers, no fc
    one_layer = _edit(_eagle1(tiny_lm, tmp_path / "e"), weights=lambda s: s.pop("fc.weight"))  # one layer, no fc
    gpt2 = _edit(_eagle1(tiny_lm, tmp_path / "f"), {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"})
    for folder in (tmp_path / "lm", one_layer, gpt2):
        with pytest.raises(SpeculatorLoadError) as e:
            detect(folder)
        assert e.value.key == "architectures" and e.value.file == str(folder / "config.json")
        assert str(folder / "config.json") in str(e.value)
    (tmp_path / "empty").mkdir()
    with pytest.raises(SpeculatorLoadError, match="config.json") as e:
        detect(tmp_path / "empty")
    assert e.value.key == "config.json"


def test_the_target_returns_the_union_of_the_eagle3_heads_layers(tiny_lm, tmp_path):
    from tests.speculator_checkpoints.medusa import write_medusa

    e1, e3 = _eagle1(tiny_lm, tmp_path / "e1"), _eagle3(tmp_path / "e3", layer_ids=[5, 1, 4])
    medusa = write_medusa(tmp_path / "m", H, V)
    default = _eagle3(tmp_path / "e3d", layer_ids=None)
    assert aux_hidden_state_layers(str(e1), 6) == [] == aux_hidden_state_layers(f"{e1},{medusa}", 6)
    assert aux_hidden_state_layers("", 6) == [] == aux_hidden_state_layers("auto", 6)  # no trained head here
    assert aux_hidden_state_layers(f"{e1},{e3},{medusa}", 6) == [1, 4, 5]  # sorted: the wire's order
    assert aux_hidden_state_layers(f"{medusa},{default}", 6) == [2, 3]  # 2, 3, 3: each layer once
    assert aux_hidden_state_layers(f"{default}", 32) == [2, 16, 29]
    assert list(served_heads(f"{e1},{e3},{medusa}")) == ["eagle", "eagle3", "medusa"]
    assert aux_hidden_state_layers(str(e3), 5) == [1, 4, 5]  # 5 of a 5-layer target: its last layer's output
    with pytest.raises(SpeculatorLoadError, match="eagle_aux_hidden_state_layer_ids"):
        aux_hidden_state_layers(str(e3), 4)  # layer 5 of a 4-layer target


def test_the_banner_names_each_published_variant(tiny_lm, tmp_path):
    """describe_variant (the launcher's line per head) names the layout and the variant's features."""
    from spec_decode.proposers.speculators.layouts import describe_variant
    from tests.speculator_checkpoints.medusa import write_medusa

    emb = tiny_lm.get_input_embeddings().weight.detach()
    cases = {
        _eagle1(tiny_lm, tmp_path / "a", qkv_bias="qkv_bias", para_norm=True):
            ("eagle", "EAGLE-1, the EAGLE authors' layout, q/k/v biases, HASS norms"),
        _eagle1(tiny_lm, tmp_path / "b", layout="vllm_script"): ("eagle", "EAGLE-1, vLLM's conversion script"),
        write_eagle1(tmp_path / "c", emb, HEADS, KV, INTER, layout="vllm", fmt="safetensors",
                     token_map=torch.arange(40)): ("eagle", "EAGLE-1, vLLM's conversion, a truncated vocabulary of 40"),
        _eagle3(tmp_path / "d", layer_ids=[1, 3, 5], norm_before_fc=True):
            ("eagle3", "EAGLE-3, the EAGLE authors' layout, norm_before_fc, output-of-layer ids, read +1 [1, 3, 5]"),
        write_eagle3(tmp_path / "e", 48, V, 6, KV, INTER, 48, layout="speculators", target_hidden=H,
                     embedding=torch.randn(V, 48)): ("eagle3", "EAGLE-3, the speculators library's layout, "
                                                               "target_hidden_size 32"),
        write_medusa(tmp_path / "f", H, V, layout="medusa_v2", fmt="pt"):
            ("medusa", "Medusa, FasterDecoding's layout, version 2 (the target's LM head)"),
        write_medusa(tmp_path / "g", H, V, layout="medusa2_full"): ("medusa", "Medusa-2, the heads of a full model"),
    }
    for folder, (method, words) in cases.items():
        assert detect(folder) == method
        assert describe_variant(folder, method) == words
    assert describe_variant(tmp_path / "missing", "eagle") == "?"
