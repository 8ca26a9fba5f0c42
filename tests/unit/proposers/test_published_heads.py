"""Every published speculator layout served through the step models in process (draft_model, target_model, verifier
as the server builds them), on the tiny random target: greedy output is the target's own for k in {1, 4}, and sampled
output keeps the target's law (the second token's marginal over seeds, the first one a drafted step emits)."""

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from tests.helpers import tiny_head_params
from tests.speculator_checkpoints.arctic import write_arctic
from tests.speculator_checkpoints.eagle import write_eagle1, write_eagle3
from tests.speculator_checkpoints.medusa import write_medusa
from tests.speculator_checkpoints.mlp import write_mlp_speculator

# layout -> (method, writer of a head for the tiny target: hidden 32, vocabulary 97, 4 heads, 2 key/value heads, MLP 64,
# 2 layers)
LAYOUTS = {
    "eagle1": ("eagle", lambda d, lm: write_eagle1(d, lm.get_input_embeddings().weight, 4, 2, 64)),
    "eagle1_vllm": ("eagle", lambda d, lm: write_eagle1(d, lm.get_input_embeddings().weight, 4, 2, 64, layout="vllm",
                                                        fmt="safetensors")),
    "eagle3": ("eagle3", lambda d, lm: write_eagle3(d, 32, 97, 4, 2, 64, 48, layer_ids=[0, 1, 1])),
    "medusa": ("medusa", lambda d, lm: write_medusa(d, 32, 97, num_heads=3)),
    "medusa_vllm": ("medusa", lambda d, lm: write_medusa(d, 32, 97, num_heads=3, layout="vllm")),
    "mlp_speculator": ("mlp_speculator", lambda d, lm: write_mlp_speculator(d, 32, 97, n_predict=3)),
    "arctic_mlp": ("arctic", lambda d, lm: write_arctic(d, 32, 97, kind="mlp")),
    "arctic_lstm": ("arctic", lambda d, lm: write_arctic(d, 32, 97, kind="lstm")),
}


# Published variants of those layouts (their maths against their authors': tests/unit/proposers/
# test_eagle_published.py), served end to end for greedy output. The sampled law is checked per proposer above: it
# holds whatever a head drafts (rejection sampling), so the variants, which change only what is drafted, do not
# repeat its 1,000 runs.
VARIANTS = {
    # EAGLE-1: q/k/v biases (the authors' Qwen2 heads) and HASS's enorm / hnorm; vLLM's conversion script's layout
    "eagle1_qwen2_hass": ("eagle", lambda d, lm: write_eagle1(d, lm.get_input_embeddings().weight, 4, 2, 64,
                                                              qkv_bias="qkv_bias", para_norm=True)),
    "eagle1_vllm_script": ("eagle", lambda d, lm: write_eagle1(d, lm.get_input_embeddings().weight, 4, 2, 64,
                                                               layout="vllm_script")),
    # EAGLE-3 in the speculators library's layout, wider than the target (target_hidden_size), with
    # norm_before_residual, norm_before_fc and layer L (2: the last layer's output)
    "eagle3_speculators": ("eagle3", lambda d, lm: write_eagle3(
        d, 48, 97, 6, 2, 64, 48, layout="speculators", layer_ids=[0, 1, 2], target_hidden=32,
        embedding=torch.randn(97, 48, generator=torch.Generator().manual_seed(1)), norm_before_residual=True,
        norm_before_fc=True)),
}


def _ensemble(folder, tiny_dir):
    from spec_decode.serving.draft_model import DraftBackend
    from spec_decode.serving.local_ensemble import LocalEnsemble
    from spec_decode.serving.target_model import TargetBackend
    from spec_decode.serving.verifier_model import VerifierBackend

    params = {"draft_model_path": "", "suffix_backend": "python", "device": "cpu",
              **tiny_head_params(folder, tiny_dir)}
    target = TargetBackend({"model_path": str(tiny_dir), "device": "cpu"}, None, params)
    return LocalEnsemble(DraftBackend(params, None, {"model_path": str(tiny_dir)}), target,
                         VerifierBackend({"backend": "torch", "num_threads": "0"}))


def _run(ens, tokenizer, method, seq, prompt, n, k, **kw):
    from spec_decode.generation import Generation
    from spec_decode.request import GenerationRequest

    req = GenerationRequest("x", n, speculative_method=method, num_draft_tokens=k, **kw)
    gen = Generation(seq, prompt, req, tokenizer, [], 256, kw.get("random_seed", 0))
    while not gen.finished:
        (result,) = ens.run_round([gen.next_step()])
        gen.commit(result)
    ens.release([gen.next_step()])
    return gen


def _served(name, tiny_lm, tiny_dir, tmp_path_factory):
    method, write = {**LAYOUTS, **VARIANTS}[name]
    folder = write(tmp_path_factory.mktemp(name) / "head", tiny_lm)
    return method, _ensemble(folder, tiny_dir)


@pytest.fixture(scope="module", params=list(LAYOUTS))
def served(request, tiny_lm, tiny_dir, tmp_path_factory):
    return _served(request.param, tiny_lm, tiny_dir, tmp_path_factory)


@pytest.fixture(scope="module", params=list(VARIANTS))
def served_variant(request, tiny_lm, tiny_dir, tmp_path_factory):
    return _served(request.param, tiny_lm, tiny_dir, tmp_path_factory)


PROMPT = [5, 17, 3, 9]


def test_greedy_output_is_the_target_s_for_k_1_and_4(served, tiny_lm, real_tokenizer):
    _greedy_is_the_target_s(served, tiny_lm, real_tokenizer)


def test_a_published_variant_s_greedy_output_is_the_target_s(served_variant, tiny_lm, real_tokenizer):
    _greedy_is_the_target_s(served_variant, tiny_lm, real_tokenizer)


def _greedy_is_the_target_s(served, tiny_lm, real_tokenizer):
    """Greedy output equals the target's own for k = 1 and 4, and every step drafts."""
    method, ens = served
    with torch.inference_mode():
        ref = tiny_lm.generate(torch.tensor([PROMPT]), max_new_tokens=24, do_sample=False, eos_token_id=None,
                               pad_token_id=0)[0, len(PROMPT):].tolist()
    for k in (1, 4):
        gen = _run(ens, real_tokenizer, method, 1 + k, PROMPT, 24, k)
        assert gen.output_ids == ref, (method, k)
        assert gen.stats.steps - 1 <= gen.stats.draft_tokens <= k * gen.stats.steps, gen.stats  # every step drafts


def test_sampled_output_keeps_the_target_s_law(served, tiny_lm, real_tokenizer):
    method, ens = served
    with torch.inference_mode():
        p1 = torch.softmax(tiny_lm(torch.tensor([PROMPT])).logits[0, -1].double(), -1)
        p2 = torch.softmax(tiny_lm(torch.tensor([[*PROMPT, t] for t in range(97)])).logits[:, -1].double(), -1)
    marginal = (p1[:, None] * p2).sum(0).numpy()
    n = 1000
    gens = [_run(ens, real_tokenizer, method, 100 + s, PROMPT, 2, 3, temperature=1.0, random_seed=s) for s in range(n)]
    assert sum(g.stats.draft_tokens for g in gens) >= n  # the second step drafted
    counts = np.bincount([g.output_ids[1] for g in gens], minlength=97)
    big = marginal * n >= 5  # the rest pooled into one bin
    observed, expected = counts[big], marginal[big] * n
    if (~big).any():
        observed, expected = np.append(observed, counts[~big].sum()), np.append(expected, marginal[~big].sum() * n)
    assert chisquare(observed, expected * observed.sum() / expected.sum()).pvalue > 1e-3, (method, counts, marginal)
