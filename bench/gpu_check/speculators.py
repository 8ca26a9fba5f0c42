"""Random speculator checkpoints of the GPU check's random target, written in the layouts their authors publish.

The decoding part (:mod:`.decoding`) serves one head of each method of ``speculator_path``
(``spec_decode.proposers.speculators.layouts``) beside the draft LM, and the same heads in the other published layouts
of their method, whose drafts must equal theirs. Each folder holds the config keys and weight names of its layout as
the public repositories write them (the same as the test fixtures' writers, ``tests/speculator_checkpoints/``, which
code under ``bench/`` does not import); the weights are random, of the target's sizes, in bfloat16 as the target is
saved. Nothing here is downloaded.

====================== ======================================================================================
key                    layout
====================== ======================================================================================
``eagle``              EAGLE-1/2 as the EAGLE authors publish it (SafeAILab/EAGLE, ``yuhuili/EAGLE-*``): a
                       one-layer ``LlamaForCausalLM`` config; ``pytorch_model.bin`` with ``fc.weight``,
                       ``fc.bias``, ``layers.0.*`` (no input norm) and ``embed_tokens.weight`` (the target's);
                       with q/k/v biases (``qkv_bias``, the authors' Qwen2 heads) and HASS's ``enorm`` / ``hnorm``
``eagle3``             EAGLE-3 (``LlamaForCausalLMEagle3`` with ``draft_vocab_size``; ``pytorch_model.bin`` with
                       ``fc.weight`` [H, 3H], ``midlayer.*``, ``norm.weight``, ``lm_head.weight``, ``d2t``,
                       ``t2d``), the target's embedding shared; a draft vocabulary of every other token; layers
                       2, L // 2 and L (the last layer's output), ``norm_before_fc``, ``norm_before_residual``
``medusa``             FasterDecoding/Medusa: ``medusa_num_heads`` 3 (k is capped at 3), ``medusa_lm_head.
                       safetensors`` with ``{i}.0.linear.{weight,bias}`` and ``{i}.1.weight`` (the target's LM
                       head, as Medusa's trainer initialises it)
``mlp_speculator``     IBM fms-extras ``MLPSpeculatorPreTrainedModel``, ``n_predict`` 3, ``tie_weights``,
                       ``scale_input``: ``model.safetensors`` named ``speculator.{emb,proj,ln,head}.*``, each tied
                       tensor saved once (``save_pretrained``)
``arctic``             Arctic ``ArcticLSTMSpeculatorPreTrainedModel`` (``method: sum_lstm``, ``tie_weights``,
                       ``tie_lstm_embs``, ``scale_input``), ``n_predict`` 3: ``pytorch_model.bin`` as ArcticTraining
                       saves it
``eagle:vllm``         the ``eagle`` head in vLLM's converted layout (``EAGLEModel``: the Llama config under
                       ``model``, ``model.``-prefixed names, ``lm_head.weight``)
``medusa:vllm``        the ``medusa`` head in vLLM's layout (``MedusaModel``, ``blocks.{i}.layers.0.*``,
                       ``original_lm_head``: the target's LM head shared)
``arctic:mlp``         the ``mlp_speculator`` head as Arctic's ``ArcticMLPSpeculatorPreTrainedModel``
                       (``pytorch_model.bin`` with bare names, every tied name)
``eagle:vllm_script``  the ``eagle`` head as vLLM's conversion script writes it (``{"model_type": "eagle",
                       "model": <the authors' config with eagle_fc_bias>}``, model.safetensors, the authors' names
                       and ``lm_head.weight``)
``eagle3:speculators`` the ``eagle3`` head in the ``speculators`` library's layout (``Eagle3Speculator``,
                       ``transformer_layer_config``, ``layers.0.*``, a zero ``fc.bias``, the target's embedding)
``medusa:v2``          the ``medusa`` head as Medusa's ``version: "2"`` (``train_legacy.py``): its blocks only,
                       projected by the target's LM head (which is what ``medusa``'s projections hold)
``medusa:full``        the ``medusa`` head inside a Medusa-2 full model (``FasterDecoding/medusa-1.0-*``): the
                       base model's config with ``medusa_num_heads``, ``medusa_head.*`` in a second shard under
                       ``model.safetensors.index.json``
``eagle3:specforge``   the ``eagle3`` head with its layer ids in SpecForge's output-of-layer convention (2, L // 2
                       and L written as 1, L // 2 - 1, L - 1: read one later, as SGLang reads them)
====================== ======================================================================================
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

SERVED = ("eagle", "eagle3", "medusa", "mlp_speculator", "arctic")  # one head per method, served together
ALTERNATIVES = {  # another layout of a served head -> (the method that serves it, the served head it must equal)
    "eagle:vllm": ("eagle", "eagle"),
    "medusa:vllm": ("medusa", "medusa"),
    "arctic:mlp": ("arctic", "mlp_speculator"),
    "eagle:vllm_script": ("eagle", "eagle"),
    "eagle3:speculators": ("eagle3", "eagle3"),
    "medusa:v2": ("medusa", "medusa"),
    "medusa:full": ("medusa", "medusa"),
    "eagle3:specforge": ("eagle3", "eagle3"),
}
N_PREDICT = 3  # Medusa's heads and the MLP / Arctic speculators' n_predict: below K_DECODE, so k is capped
DTYPE = torch.bfloat16  # as the target is saved
_STD = 0.02  # the random linears' std (the target's initializer_range)


def _write(folder: Path, cfg: dict[str, Any], state: dict[str, torch.Tensor], file: str) -> Path:
    """``config.json`` and the weights file ``file`` (safetensors when it ends so, else ``torch.save``); floating
    tensors in :data:`DTYPE`, tensors shared between names kept shared (a ``.bin``) or saved once under their first
    name (safetensors, as ``save_pretrained`` does)."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(cfg, indent=2))
    cast: dict[int, torch.Tensor] = {}
    out: dict[str, torch.Tensor] = {}
    for name, t in state.items():
        if id(t) in cast:
            if file.endswith(".safetensors"):
                continue
        else:
            cast[id(t)] = (t.to(DTYPE) if t.is_floating_point() else t).contiguous()
        out[name] = cast[id(t)]
    if file.endswith(".safetensors"):
        from safetensors.torch import save_file

        save_file(out, str(folder / file), metadata={"format": "pt"})
    else:
        torch.save(out, folder / file)
    return folder


def _llama_config(llama: dict[str, int], **extra: Any) -> dict[str, Any]:
    """A one-layer Llama config of the target's sizes, with the keys the published EAGLE configs carry."""
    return {"architectures": ["LlamaForCausalLM"], "bos_token_id": 1, "eos_token_id": 2, "hidden_act": "silu",
            "hidden_size": llama["hidden_size"], "initializer_range": _STD,
            "intermediate_size": llama["intermediate_size"], "max_position_embeddings": 4096, "model_type": "llama",
            "num_attention_heads": llama["num_attention_heads"], "num_hidden_layers": 1,
            "num_key_value_heads": llama["num_key_value_heads"], "pad_token_id": 0, "pretraining_tp": 1,
            "rms_norm_eps": 1e-05, "rope_scaling": None, "rope_theta": 10000.0, "tie_word_embeddings": False,
            "torch_dtype": "bfloat16", "transformers_version": "4.28.1", "use_cache": True,
            "vocab_size": llama["vocab_size"], **extra}


def _layer(gen: torch.Generator, llama: dict[str, int], width: int, prefix: str) -> dict[str, torch.Tensor]:
    """A Llama decoder layer's weights without its input norm (attention over inputs of ``width``)."""
    h, heads, kv, inter = (llama[k] for k in ("hidden_size", "num_attention_heads", "num_key_value_heads",
                                              "intermediate_size"))
    d = h // heads

    def w(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen) * _STD

    return {f"{prefix}self_attn.q_proj.weight": w(heads * d, width),
            f"{prefix}self_attn.k_proj.weight": w(kv * d, width),
            f"{prefix}self_attn.v_proj.weight": w(kv * d, width),
            f"{prefix}self_attn.o_proj.weight": w(h, heads * d),
            f"{prefix}mlp.gate_proj.weight": w(inter, h), f"{prefix}mlp.up_proj.weight": w(inter, h),
            f"{prefix}mlp.down_proj.weight": w(h, inter),
            f"{prefix}post_attention_layernorm.weight": 1 + 0.1 * torch.randn(h, generator=gen)}


def write_eagle1(folder: Path, llama: dict[str, int], embedding: torch.Tensor, lm_head: torch.Tensor,
                 layout: str = "authors", seed: int = 1) -> Path:
    """A random EAGLE-1/2 head: ``authors`` (SafeAILab/EAGLE), ``vllm`` (vLLM's conversion) or ``vllm_script`` (vLLM's
    conversion script); the same ``seed`` gives the same head in each."""
    gen = torch.Generator().manual_seed(seed)
    h = llama["hidden_size"]
    prefix = "model." if layout == "vllm" else ""
    state = _layer(gen, llama, h, f"{prefix}layers.0.")
    state["fc.weight"] = torch.randn(h, 2 * h, generator=gen) * _STD
    state["fc.bias"] = torch.randn(h, generator=gen) * _STD
    # two published variants at once: q/k/v biases (the authors' Qwen2 heads) and HASS's enorm / hnorm
    d = h // llama["num_attention_heads"]
    for p, rows in (("q", h), ("k", llama["num_key_value_heads"] * d), ("v", llama["num_key_value_heads"] * d)):
        state[f"{prefix}layers.0.self_attn.{p}_proj.bias"] = torch.randn(rows, generator=gen) * _STD
    state["enorm.weight"] = 1 + 0.1 * torch.randn(h, generator=gen)
    state["hnorm.weight"] = 1 + 0.1 * torch.randn(h, generator=gen)
    state[f"{prefix}embed_tokens.weight"] = embedding
    variants = {"qkv_bias": True, "add_para_norm": True}
    if layout == "vllm":
        state["lm_head.weight"] = lm_head
        cfg = {"architectures": ["EAGLEModel"], "model_type": "eagle", "model": _llama_config(llama, **variants),
               "num_lookahead_tokens": 5, "eagle_fc_bias": True, "truncated_vocab_size": llama["vocab_size"]}
    elif layout == "vllm_script":
        state["lm_head.weight"] = lm_head
        cfg = {"model_type": "eagle", "model": {**_llama_config(llama, **variants), "eagle_fc_bias": True}}
        return _write(Path(folder), cfg, state, "model.safetensors")
    else:
        assert layout == "authors", layout
        cfg = _llama_config(llama, **variants)
    return _write(Path(folder), cfg, state, "pytorch_model.bin")


def write_eagle3(folder: Path, llama: dict[str, int], lm_head: torch.Tensor, seed: int = 2,
                 embedding: torch.Tensor | None = None, specforge: bool = False) -> Path:
    """A random EAGLE-3 head (``LlamaForCausalLMEagle3``) over a draft vocabulary of every other target token, its
    LM head the target's rows of those tokens; the target's embedding shared; with published variants: the
    auxiliary layers 2, L // 2 and L (the last layer's output, as ``nvidia/gpt-oss-120b-Eagle3-v3`` names it),
    ``norm_before_fc`` (``input_norm.weight`` over the three) and ``norm_before_residual``. With ``embedding`` (the
    target's), the same head in the ``speculators`` library's layout (``Eagle3Speculator``:
    ``transformer_layer_config``, ``layers.0.*``, a zero ``fc.bias``, its embedding saved)."""
    gen = torch.Generator().manual_seed(seed)
    h, v = llama["hidden_size"], llama["vocab_size"]
    layers = llama["num_hidden_layers"]
    ids = torch.arange(0, v, 2)
    state = _layer(gen, llama, 2 * h, "midlayer.")
    state["midlayer.input_layernorm.weight"] = 1 + 0.1 * torch.randn(h, generator=gen)
    state["midlayer.hidden_norm.weight"] = 1 + 0.1 * torch.randn(h, generator=gen)
    state["fc.weight"] = torch.randn(h, 3 * h, generator=gen) * _STD
    state["input_norm.weight"] = 1 + 0.1 * torch.randn(3 * h, generator=gen)
    aux = [2, layers // 2, layers]
    if specforge:  # the same layers named as outputs of the layer before each
        aux = [i - 1 for i in aux]
    variants = {"norm_before_fc": True, "norm_before_residual": True}
    state["norm.weight"] = 1 + 0.1 * torch.randn(h, generator=gen)
    state["lm_head.weight"] = lm_head[ids]
    state["d2t"] = ids - torch.arange(len(ids))
    t2d = torch.zeros(v, dtype=torch.bool)
    t2d[ids] = True
    state["t2d"] = t2d
    if embedding is not None:
        state = {("layers.0." + k[len("midlayer."):] if k.startswith("midlayer.") else k): t for k, t in state.items()}
        state["fc.bias"], state["embed_tokens.weight"] = torch.zeros(h), embedding
        cfg = {"architectures": ["Eagle3Speculator"], "speculators_model_type": "eagle3",
               "model_type": "speculators", "draft_vocab_size": len(ids), "target_hidden_size": None,
               "eagle_aux_hidden_state_layer_ids": aux, "transformer_layer_config": _llama_config(llama), **variants}
        return _write(Path(folder), cfg, state, "model.safetensors")
    cfg = _llama_config(llama, draft_vocab_size=len(ids), bias=False, **variants,
                        eagle_config={"eagle_aux_hidden_state_layer_ids": aux})
    cfg["architectures"] = ["LlamaForCausalLMEagle3"]
    return _write(Path(folder), cfg, state, "pytorch_model.bin")


def write_medusa(folder: Path, llama: dict[str, int], lm_head: torch.Tensor, layout: str = "medusa",
                 seed: int = 3) -> Path:
    """A Medusa head of :data:`N_PREDICT` heads of one residual block each, random blocks, every head's projection
    the target's LM head: ``medusa`` (FasterDecoding's layout), ``v2`` (its ``version: "2"``: blocks only, projected
    by the target's LM head), ``full`` (inside a Medusa-2 full model's shards) or ``vllm`` (vLLM's,
    ``original_lm_head``: the projection is not in the file); the same ``seed`` gives the same head in each."""
    gen = torch.Generator().manual_seed(seed)
    h, n = llama["hidden_size"], N_PREDICT
    state: dict[str, torch.Tensor] = {}
    for i in range(n):
        w, b = torch.randn(h, h, generator=gen) * _STD, torch.randn(h, generator=gen) * _STD
        if layout in ("medusa", "v2", "full"):
            # each head its own copy: FasterDecoding's heads are separate modules, saved name by name
            state[f"{i}.0.linear.weight"], state[f"{i}.0.linear.bias"] = w, b
            if layout in ("medusa", "full"):
                state[f"{i}.1.weight"] = lm_head.clone()
        else:
            state[f"blocks.{i}.layers.0.weight"], state[f"blocks.{i}.layers.0.bias"] = w, b
    if layout == "full":  # the heads inside a full model's second shard
        folder = Path(folder)
        shards = {"model-00001-of-00002.safetensors": {"model.norm.weight": torch.ones(h)},
                  "model-00002-of-00002.safetensors": {f"medusa_head.{k}": t for k, t in state.items()}}
        for name, part in shards.items():
            _write(folder, {}, part, name)  # its config.json is written below
        index = {"metadata": {}, "weight_map": {k: f for f, part in shards.items() for k in part}}
        (folder / "model.safetensors.index.json").write_text(json.dumps(index))
        cfg_full = _llama_config(llama, medusa_num_heads=n, medusa_num_layers=1)
        cfg_full["num_hidden_layers"] = llama["num_hidden_layers"]
        (folder / "config.json").write_text(json.dumps(cfg_full))
        return folder
    if layout in ("medusa", "v2"):
        cfg: dict[str, Any] = {"base_model_name_or_path": "gpu-check-random-llama", "medusa_num_heads": n,
                               "medusa_num_layers": 1, "transformers_version": "4.41.2",
                               **({"version": "2"} if layout == "v2" else {})}
        return _write(Path(folder), cfg, state, "medusa_lm_head.pt" if layout == "v2" else
                      "medusa_lm_head.safetensors")
    assert layout == "vllm", layout
    cfg = {"architectures": ["MedusaModel"], "hidden_size": h, "max_paths": 64, "max_seq_len": 2**20,
           "medusa_fc_bias": True, "model_type": "medusa", "num_heads": n, "num_hidden_layers": 1,
           "original_lm_head": True, "topk": 10, "torch_dtype": "bfloat16", "transformers_version": "4.41.2",
           "truncated_vocab_size": llama["vocab_size"], "vocab_size": llama["vocab_size"]}
    return _write(Path(folder), cfg, state, "model.safetensors")


def mlp_tensors(llama: dict[str, int], inner: int, seed: int = 4) -> dict[str, torch.Tensor]:
    """fms-extras ``MLPSpeculator``'s state dict with ``tie_weights`` (every name; the tied stages share one tensor:
    embeddings, LM heads and norms stage 0's, projections 1.. stage 1's), random as its ``reset_parameters``."""
    gen = torch.Generator().manual_seed(seed)
    h, v, n = llama["hidden_size"], llama["vocab_size"], N_PREDICT
    emb = torch.randn(v, inner, generator=gen) * inner**-0.5
    proj = [torch.randn(inner, h, generator=gen) * inner**-0.5, torch.randn(inner, inner, generator=gen) * inner**-0.5]
    head = torch.randn(v, inner, generator=gen) * inner**-0.5
    ln_w, ln_b = 1 + 0.2 * torch.randn(inner, generator=gen), 0.2 * torch.randn(inner, generator=gen)
    out: dict[str, torch.Tensor] = {}
    for i in range(n):
        out[f"emb.{i}.weight"], out[f"proj.{i}.weight"], out[f"head.{i}.weight"] = emb, proj[min(i, 1)], head
        out[f"ln.{i}.weight"], out[f"ln.{i}.bias"] = ln_w, ln_b
    return out


def _mlp_common(llama: dict[str, int]) -> dict[str, Any]:
    return {"model_type": "mlp_speculator", "n_candidates": N_PREDICT, "n_predict": N_PREDICT,
            "top_k_tokens_per_head": [1] * N_PREDICT, "torch_dtype": "bfloat16", "transformers_version": "4.44.2",
            "vocab_size": llama["vocab_size"]}


def write_mlp_speculator(folder: Path, llama: dict[str, int], inner: int, layout: str = "fms") -> Path:
    """The MLP speculator of :func:`mlp_tensors`: ``fms`` (IBM's ``MLPSpeculatorPreTrainedModel``, safetensors named
    ``speculator.*``, each tied tensor once) or ``arctic`` (``ArcticMLPSpeculatorPreTrainedModel``, a
    ``pytorch_model.bin`` of bare names as ArcticTraining saves it)."""
    tensors = mlp_tensors(llama, inner)
    cfg = {"emb_dim": llama["hidden_size"], "inner_dim": inner, "scale_input": True, "tie_weights": True,
           **_mlp_common(llama)}
    if layout == "fms":
        cfg["architectures"] = ["MLPSpeculatorPreTrainedModel"]
        return _write(Path(folder), cfg, {f"speculator.{k}": t for k, t in tensors.items()}, "model.safetensors")
    assert layout == "arctic", layout
    cfg = {"architectures": ["ArcticMLPSpeculatorPreTrainedModel"], "base_model_archs": ["LlamaForCausalLM"],
           "base_model_name_or_path": "gpu-check-random-llama", **cfg}
    return _write(Path(folder), cfg, tensors, "pytorch_model.bin")


def write_arctic_lstm(folder: Path, llama: dict[str, int], inner: int, seed: int = 5) -> Path:
    """A random Arctic LSTM speculator (``method: sum_lstm``, ``tie_weights``, ``tie_lstm_embs``, ``scale_input``)
    as ArcticTraining saves it: ``{gate}_emb.0.weight`` (one tensor for the four gates), ``{gate}_proj.{0,1}.weight``,
    ``cell_ln.0.*``, ``state_ln.0.*``, ``head.{i}.weight`` (one tensor)."""
    gen = torch.Generator().manual_seed(seed)
    h, v = llama["hidden_size"], llama["vocab_size"]

    def normal(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen) * min(shape) ** -0.5

    emb, head = normal(v, inner), normal(v, inner)
    state: dict[str, torch.Tensor] = {}
    for g in ("forget", "input", "output", "cell"):
        state[f"{g}_emb.0.weight"] = emb
        state[f"{g}_proj.0.weight"], state[f"{g}_proj.1.weight"] = normal(inner, h), normal(inner, inner)
    for ln in ("cell_ln", "state_ln"):
        state[f"{ln}.0.weight"] = 1 + 0.2 * torch.randn(inner, generator=gen)
        state[f"{ln}.0.bias"] = 0.2 * torch.randn(inner, generator=gen)
    for i in range(N_PREDICT):
        state[f"head.{i}.weight"] = head
    cfg = {"architectures": ["ArcticLSTMSpeculatorPreTrainedModel"], "base_model_archs": ["LlamaForCausalLM"],
           "base_model_name_or_path": "gpu-check-random-llama", "input_hidden_dim": h, "inner_dim": str(inner),
           "proj_dim": str(inner), "emb_dim": str(inner), "method": "sum_lstm", "scale_input": True,
           "tie_weights": True, "tie_lstm_embs": True, **_mlp_common(llama)}
    return _write(Path(folder), cfg, state, "pytorch_model.bin")


def write_speculators(folder: Path, llama: dict[str, int], embedding: torch.Tensor, lm_head: torch.Tensor
                      ) -> dict[str, Path]:
    """Every checkpoint of the module docstring's table under ``folder``.

    Args:
        llama: the target's ``LlamaConfig`` sizes.
        embedding, lm_head: the target's input embedding and LM head [V, H] (CPU, as saved).

    Returns:
        key of the table -> folder.
    """
    folder = Path(folder)
    embedding, lm_head = embedding.detach().cpu(), lm_head.detach().cpu()
    inner = max(16, llama["hidden_size"] // 2)
    return {
        "eagle": write_eagle1(folder / "eagle1", llama, embedding, lm_head),
        "eagle3": write_eagle3(folder / "eagle3", llama, lm_head),
        "medusa": write_medusa(folder / "medusa", llama, lm_head),
        "mlp_speculator": write_mlp_speculator(folder / "mlp_speculator", llama, inner),
        "arctic": write_arctic_lstm(folder / "arctic_lstm", llama, inner),
        "eagle:vllm": write_eagle1(folder / "eagle1_vllm", llama, embedding, lm_head, layout="vllm"),
        "medusa:vllm": write_medusa(folder / "medusa_vllm", llama, lm_head, layout="vllm"),
        "arctic:mlp": write_mlp_speculator(folder / "arctic_mlp", llama, inner, layout="arctic"),
        "eagle:vllm_script": write_eagle1(folder / "eagle1_vllm_script", llama, embedding, lm_head,
                                          layout="vllm_script"),
        "eagle3:speculators": write_eagle3(folder / "eagle3_speculators", llama, lm_head, embedding=embedding),
        "medusa:v2": write_medusa(folder / "medusa_v2", llama, lm_head, layout="v2"),
        "medusa:full": write_medusa(folder / "medusa_full", llama, lm_head, layout="full"),
        "eagle3:specforge": write_eagle3(folder / "eagle3_specforge", llama, lm_head, specforge=True),
    }
