"""Tiny EAGLE-1/2 and EAGLE-3 heads written as their authors (SafeAILab/EAGLE) and vLLM publish them."""

from __future__ import annotations

import json
from pathlib import Path

import torch


def _llama_config(hidden: int, vocab: int, heads: int, kv_heads: int, inter: int, **extra) -> dict:
    """A one-layer Llama config of the head's sizes, with the keys the published configs carry."""
    return {"architectures": ["LlamaForCausalLM"], "bos_token_id": 1, "eos_token_id": 2, "hidden_act": "silu",
            "hidden_size": hidden, "initializer_range": 0.02, "intermediate_size": inter,
            "max_position_embeddings": 2048, "model_type": "llama", "num_attention_heads": heads,
            "num_hidden_layers": 1, "num_key_value_heads": kv_heads, "pad_token_id": 0, "pretraining_tp": 1,
            "rms_norm_eps": 1e-05, "rope_scaling": None, "rope_theta": 10000.0, "tie_word_embeddings": False,
            "torch_dtype": "float16", "transformers_version": "4.28.1", "use_cache": True, "vocab_size": vocab,
            **extra}


def _layer(gen: torch.Generator, hidden: int, heads: int, kv_heads: int, inter: int, width: int, prefix: str,
           scale: float) -> dict[str, torch.Tensor]:
    d = hidden // heads

    def w(*shape):
        return torch.randn(*shape, generator=gen) * scale

    return {f"{prefix}self_attn.q_proj.weight": w(heads * d, width),
            f"{prefix}self_attn.k_proj.weight": w(kv_heads * d, width),
            f"{prefix}self_attn.v_proj.weight": w(kv_heads * d, width),
            f"{prefix}self_attn.o_proj.weight": w(hidden, heads * d),
            f"{prefix}mlp.gate_proj.weight": w(inter, hidden), f"{prefix}mlp.up_proj.weight": w(inter, hidden),
            f"{prefix}mlp.down_proj.weight": w(hidden, inter),
            f"{prefix}post_attention_layernorm.weight": 1 + 0.1 * torch.randn(hidden, generator=gen)}


def _save(state: dict, folder: Path, fmt: str, name: str) -> None:
    state = {k: v.to(torch.float16) if v.is_floating_point() else v for k, v in state.items()}
    if fmt == "safetensors":
        from safetensors.torch import save_file

        save_file({k: v.contiguous() for k, v in state.items()}, str(folder / f"{name}.safetensors"))
    else:
        torch.save(state, folder / f"{name}.bin")


def write_eagle1(folder: Path, embedding: torch.Tensor, heads: int, kv_heads: int, inter: int,
                 layout: str = "authors", fmt: str = "bin", bias: bool | None = None, seed: int = 0,
                 lm_head: torch.Tensor | None = None, drop: str = "", qkv_bias: str = "", para_norm: bool = False,
                 token_map: torch.Tensor | None = None, **config) -> Path:
    """An EAGLE-1/2 head over a target whose input embedding is ``embedding`` [V, H], random layer.

    Args:
        layout: ``authors`` (yuhuili/EAGLE-*: a one-layer LlamaForCausalLM config, ``fc.*``, ``layers.0.*`` without
            the input norm, ``embed_tokens.weight``; ``"bias": false`` in the config only when ``bias`` is False),
            ``vllm`` (``EAGLEModel`` config with the Llama config under ``model``, ``model.``-prefixed layer and
            embedding, ``lm_head.weight``: ``lm_head`` or the embedding) or ``vllm_script`` (what vLLM's
            ``vLLM_compatible_EAGLE_ckpt.py`` makes of an authors' head: ``{"model_type": "eagle", "model": <the
            authors' config, with eagle_fc_bias: true when the head has fc.bias>}``, the authors' weight names plus
            ``lm_head.weight``, model.safetensors).
        fmt: ``bin`` (pytorch_model.bin, as published) or ``safetensors`` (model.safetensors).
        drop: a weight name to leave out (load-error tests).
        qkv_bias: ``""`` (none), ``"qkv_bias"`` (the EAGLE authors' Qwen2 heads: ``"qkv_bias": true`` and
            ``layers.0.self_attn.{q,k,v}_proj.bias``) or ``"attention_bias"`` (Llama's: also ``o_proj.bias``).
        para_norm: HASS's ``add_para_norm`` (in the Llama config) and its ``enorm.weight`` / ``hnorm.weight``.
        token_map: a truncated vocabulary (vLLM's layouts): ``token_map`` and ``truncated_vocab_size`` written, and
            ``lm_head`` kept as given (its rows, or the target's whole [V, H] one).
        config: config keys to set or override (the Llama config's, under ``model`` for vLLM's layouts).
    """
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(seed)
    v, h = embedding.shape
    prefix = "model." if layout == "vllm" else ""
    state = _layer(gen, h, heads, kv_heads, inter, h, f"{prefix}layers.0.", 0.3)
    state["fc.weight"] = torch.randn(h, 2 * h, generator=gen) * 0.3
    with_bias = bias if bias is not None else layout != "vllm"
    if with_bias:
        state["fc.bias"] = torch.randn(h, generator=gen) * 0.1
    d = h // heads
    if qkv_bias:
        for p, rows in (("q", heads * d), ("k", kv_heads * d), ("v", kv_heads * d)):
            state[f"{prefix}layers.0.self_attn.{p}_proj.bias"] = torch.randn(rows, generator=gen) * 0.2
        if qkv_bias == "attention_bias":
            state[f"{prefix}layers.0.self_attn.o_proj.bias"] = torch.randn(h, generator=gen) * 0.2
    if para_norm:
        state["enorm.weight"] = 1 + 0.2 * torch.randn(h, generator=gen)
        state["hnorm.weight"] = 1 + 0.2 * torch.randn(h, generator=gen)
    state[f"{prefix}embed_tokens.weight"] = embedding.detach().float().clone()
    llama = _llama_config(h, v, heads, kv_heads, inter, **({qkv_bias: True} if qkv_bias else {}),
                          **({"add_para_norm": True} if para_norm else {}))
    n = v if token_map is None else len(token_map)
    if token_map is not None:
        state["token_map"] = token_map.to(torch.int64)
    if layout == "vllm":
        state["lm_head.weight"] = (lm_head if lm_head is not None else embedding).detach().float().clone()
        cfg = {"architectures": ["EAGLEModel"], "model_type": "eagle", "model": {**llama, **config},
               "num_lookahead_tokens": 5, "eagle_fc_bias": with_bias, "truncated_vocab_size": n}
    elif layout == "vllm_script":
        state["lm_head.weight"] = (lm_head if lm_head is not None else embedding).detach().float().clone()
        inner = {**llama, **({"bias": False} if bias is False else {}), **config}
        if with_bias:
            inner["eagle_fc_bias"] = True
        cfg = {"model_type": "eagle", "model": inner}
        fmt = "safetensors"
    else:
        cfg = {**llama, **({"bias": False} if bias is False else {}), **config}
    state.pop(drop, None)
    (folder / "config.json").write_text(json.dumps(cfg, indent=2))
    _save(state, folder, fmt, "pytorch_model" if fmt == "bin" else "model")
    return folder


def write_eagle3(folder: Path, hidden: int, vocab: int, heads: int, kv_heads: int, inter: int, draft_vocab: int,
                 layout: str = "eagle3", fmt: str = "bin", seed: int = 0, layer_ids: list[int] | None = None,
                 embedding: torch.Tensor | None = None, drop: str = "", target_hidden: int | None = None,
                 norm_before_residual: bool = False, norm_before_fc: bool = False, attention_bias: bool = False,
                 **config) -> Path:
    """An EAGLE-3 head (random weights) as the EAGLE authors' trainer, or the ``speculators`` library, writes it.

    Args:
        layout: ``eagle3`` (config ``LlamaForCausalLMEagle3``, as yuhuili/EAGLE3-* publish), ``trainer`` (the
            trainer's own ``LlamaForCausalLM`` config with ``draft_vocab_size``) or ``speculators`` (vLLM's
            ``speculators`` library, RedHatAI's heads: ``Eagle3Speculator``, sizes under
            ``transformer_layer_config``, weights ``layers.0.*``, ``fc.bias``, its own ``embed_tokens.weight``,
            model.safetensors).
        draft_vocab: N, the draft vocabulary (every other target token from 0: ``d2t`` offsets, ``t2d`` mask).
        layer_ids: written as ``eagle_config.eagle_aux_hidden_state_layer_ids`` when given (at the config's top for
            ``speculators``).
        embedding: written as ``embed_tokens.weight`` when given (else the target's is shared).
        drop: a weight name to leave out.
        target_hidden: ``target_hidden_size`` (a head of another width than the target's: ``fc`` [H, 3 x it]).
        norm_before_residual, norm_before_fc: those config flags (``norm_before_fc`` also writes
            ``input_norm.weight`` over the concatenated target states, as ``nvidia/gpt-oss-120b-Eagle3-v3``).
        attention_bias: ``attention_bias: true`` and q/k/v/o biases.
        config: config keys to set or override.
    """
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(seed)
    ht = target_hidden or hidden
    layer = "layers.0." if layout == "speculators" else "midlayer."
    state = _layer(gen, hidden, heads, kv_heads, inter, 2 * hidden, layer, 0.3)
    state[f"{layer}input_layernorm.weight"] = 1 + 0.1 * torch.randn(hidden, generator=gen)
    state[f"{layer}hidden_norm.weight"] = 1 + 0.1 * torch.randn(hidden, generator=gen)
    state["fc.weight"] = torch.randn(hidden, 3 * ht, generator=gen) * 0.3
    if layout == "speculators":
        state["fc.bias"] = torch.randn(hidden, generator=gen) * 0.1
    if norm_before_fc:
        state["input_norm.weight"] = 1 + 0.2 * torch.randn(3 * ht, generator=gen)
    if attention_bias:
        d = hidden // heads
        for p, rows in (("q", heads * d), ("k", kv_heads * d), ("v", kv_heads * d), ("o", hidden)):
            state[f"{layer}self_attn.{p}_proj.bias"] = torch.randn(rows, generator=gen) * 0.2
    state["norm.weight"] = 1 + 0.1 * torch.randn(hidden, generator=gen)
    state["lm_head.weight"] = torch.randn(draft_vocab, hidden, generator=gen) * 2.0
    ids = torch.arange(draft_vocab) * max(1, vocab // draft_vocab)
    state["d2t"] = ids - torch.arange(draft_vocab)
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[ids] = True
    state["t2d"] = t2d
    if embedding is not None:
        state["embed_tokens.weight"] = embedding.detach().float().clone()
    flags = {**({"norm_before_residual": True} if norm_before_residual else {}),
             **({"norm_before_fc": True} if norm_before_fc else {}),
             **({"target_hidden_size": target_hidden} if target_hidden else {})}
    llama = _llama_config(hidden, vocab, heads, kv_heads, inter, **({"attention_bias": True} if attention_bias else {}))
    llama["head_dim"] = hidden // heads
    if layout == "speculators":
        llama["architectures"] = ["LlamaForCausalLM"]
        cfg = {"architectures": ["Eagle3Speculator"], "speculators_model_type": "eagle3", "model_type": "speculators",
               "draft_vocab_size": draft_vocab, "norm_before_residual": norm_before_residual,
               "target_hidden_size": target_hidden, "transformer_layer_config": llama,
               "speculators_config": {"algorithm": "eagle3", "default_proposal_method": "greedy",
                                      "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": 3}],
                                      "verifier": {"architectures": ["LlamaForCausalLM"], "name_or_path": "target"}},
               **({"eagle_aux_hidden_state_layer_ids": layer_ids} if layer_ids is not None else {}),
               **({"norm_before_fc": True} if norm_before_fc else {})}
        fmt = "safetensors"
    else:
        cfg = {**llama, "draft_vocab_size": draft_vocab, "bias": False, **flags}
        cfg["architectures"] = ["LlamaForCausalLMEagle3"] if layout == "eagle3" else ["LlamaForCausalLM"]
        if layer_ids is not None:
            cfg["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": layer_ids}
    cfg.update(config)
    state.pop(drop, None)
    (folder / "config.json").write_text(json.dumps(cfg, indent=2))
    _save(state, folder, fmt, "pytorch_model" if fmt == "bin" else "model")
    return folder
