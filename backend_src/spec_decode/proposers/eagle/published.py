"""Published EAGLE-1/2 heads, as their authors and vLLM publish them, loaded into an :class:`~.model.EagleHead`.

Two layouts (:func:`load_eagle1`):

- the authors' (SafeAILab/EAGLE, ``yuhuili/EAGLE-*`` on the Hugging Face hub; EAGLE-2 drafts with the same heads):
  ``config.json`` is a plain one-layer ``LlamaForCausalLM`` config (``"bias": false`` drops ``fc``'s bias, present by
  default), weights ``pytorch_model.bin`` (or safetensors): ``fc.weight`` [H, 2H] over [embedding; hidden state],
  ``fc.bias``, one decoder layer ``layers.0.*`` without its input norm, and ``embed_tokens.weight``, a frozen copy of
  the target's; the LM head is the target's (the folder has none).
- vLLM's conversion (``vllm/model_executor/models/eagle.py``, ``transformers_utils/configs/eagle.py``): config
  ``EAGLEModel`` / ``model_type: eagle`` with the Llama config under ``model`` (``eagle_fc_bias``, ``skip_prenorm``,
  ``truncated_vocab_size``), weights ``fc.*``, ``model.layers.0.*``, ``model.embed_tokens.weight``, ``lm_head.weight``
  and, for a truncated vocabulary, ``token_map`` (the target ids of its LM head's rows). vLLM's own conversion script
  (``examples/.../vLLM_compatible_EAGLE_ckpt.py``) writes ``{"model_type": "eagle", "model": <the authors' config>}``
  with ``eagle_fc_bias: true`` inside ``model`` when the head has ``fc.bias``, and the authors' weight names.

Variants read from either layout:

- q/k/v biases (``layers.0.self_attn.{q,k,v}_proj.bias``): heads of Qwen2 targets (``yuhuili/EAGLE-Qwen2-*``), whose
  config says ``qkv_bias: true`` (the authors' ``model/cnets1.py`` builds the projections with ``bias=qkv_bias``) or
  ``model_type: qwen2``; Llama's ``attention_bias: true`` adds the output projection's bias too.
- HASS's ``add_para_norm`` (vLLM's ``eagle.py``: ``enorm`` and ``hnorm``, RMSNorms of the embedding and of the hidden
  state before ``fc``).
- a truncated vocabulary whose ``lm_head.weight`` is the target's whole [V, H] one: its ``token_map`` rows are taken
  (as vLLM's ``EAGLE.load_weights`` slices it).

A bias or norm weight present in the file is used even where the config does not name it (it was trained); one the
config names but the file lacks is refused, naming the key.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ...engine.draft_vocab import DraftVocab
from ..speculators.checkpoint import (
    SpeculatorLoadError,
    config_int,
    decoder_layer_sizes,
    expect,
    find_weights,
    load_weights,
    read_config,
    take,
)
from ..speculators.target import TargetInfo
from .model import EagleHead, rope_inv_freq

_LAYER = {  # published name under layers.0. -> EagleHead parameter
    "self_attn.q_proj.weight": "q_proj.weight", "self_attn.k_proj.weight": "k_proj.weight",
    "self_attn.v_proj.weight": "v_proj.weight", "self_attn.o_proj.weight": "o_proj.weight",
    "mlp.gate_proj.weight": "gate_proj.weight", "mlp.up_proj.weight": "up_proj.weight",
    "mlp.down_proj.weight": "down_proj.weight", "post_attention_layernorm.weight": "post_norm.weight",
}


def _bare(name: str) -> str:
    """A weight name without vLLM's ``model.`` prefixes (``model.model.x`` -> ``x`` as vLLM reads them)."""
    while name.startswith("model."):
        name = name[len("model."):]
    return name


def _normalise(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Weight names without vLLM's ``model.`` prefix (:func:`_bare`)."""
    return {_bare(name): t for name, t in state.items()}


def _flag(configured, in_file: bool) -> bool:
    """Whether an optional weight is used: as the config says when it says true; when it says nothing (None), as the
    file has it. A config that says false while the file has the weight: used (it was trained, and a head drafting
    without it drafts from another computation)."""
    return bool(configured) or in_file


def _layout(top: dict[str, Any]) -> tuple[bool, dict[str, Any]]:
    """(vLLM's layouts, the Llama config: under ``model`` in vLLM's, the config itself in the authors')."""
    vllm = "EAGLEModel" in (top.get("architectures") or []) or top.get("model_type") == "eagle"
    return vllm, top["model"] if vllm and isinstance(top.get("model"), dict) else top


def eagle1_options(top: dict[str, Any], names: set[str]) -> dict[str, Any]:
    """What an EAGLE-1/2 folder holds, from its config (``top``: config.json) and its weight names (any ``model.``
    prefixes are dropped): ``vllm`` (vLLM's layouts: the Llama config under ``model``), ``cfg`` (the Llama config)
    and whether ``fc``'s bias, the q/k/v biases, the o bias and HASS's norms are used (module docstring: the config
    says so, or the file holds them). What :func:`load_eagle1` builds and the launcher's banner names
    (:func:`~spec_decode.proposers.speculators.layouts.describe_variant`)."""
    names = {_bare(n) for n in names}
    vllm, cfg = _layout(top)
    # vLLM's config reads eagle_fc_bias at its top; vLLM's conversion script writes it into "model"
    fc_bias = top.get("eagle_fc_bias", cfg.get("eagle_fc_bias")) if vllm else top.get("bias", True)
    qkv_bias = cfg.get("qkv_bias", cfg.get("attention_bias", True if cfg.get("model_type") == "qwen2" else None))
    return {"vllm": vllm, "cfg": cfg, "fc_bias": _flag(fc_bias, "fc.bias" in names),
            "qkv_bias": _flag(qkv_bias, "layers.0.self_attn.q_proj.bias" in names),
            "o_bias": _flag(cfg.get("attention_bias"), "layers.0.self_attn.o_proj.bias" in names),
            "para_norm": _flag(cfg.get("add_para_norm", top.get("add_para_norm")), "enorm.weight" in names)}


@dataclass(frozen=True)
class Eagle1Config:
    """An EAGLE-1/2 folder's config as :func:`check_eagle1_config` read it.

    Attributes:
        top: config.json as read. vllm: whether vLLM's layouts (the Llama config under ``model``). cfg: the Llama
            config. input_norm: whether the layer has its input norm (vLLM's ``skip_prenorm: false``).
        heads, kv_heads, head_dim, intermediate: the layer's attention and MLP sizes.
    """

    top: dict[str, Any]
    vllm: bool
    cfg: dict[str, Any]
    input_norm: bool
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int


def check_eagle1_config(folder: Path, target: TargetInfo) -> Eagle1Config:
    """An EAGLE-1/2 folder's ``config.json`` (either layout of the module docstring) checked against the target,
    without reading its weights: what :func:`load_eagle1` checks first, and the launcher before it starts anything
    (:func:`~spec_decode.proposers.speculators.check_heads_fit`).

    The Llama config's ``hidden_size`` and ``vocab_size`` (at the top in the EAGLE authors' layout, under ``model``
    in vLLM's, as vLLM's ``EAGLEConfig`` reads them) are the target's, as the head's ``fc`` and its copy of the
    target's embedding are; one decoder layer.

    Args:
        folder: the head's folder.
        target: the target it drafts for (its sizes).

    Returns:
        The sizes read (:class:`Eagle1Config`).

    Raises:
        SpeculatorLoadError: naming ``config.json`` and the key that does not fit: ``hidden_size``, ``vocab_size``,
            ``num_hidden_layers`` (one layer), ``skip_output_norm: false``, a missing or non-integer size.
    """
    folder = Path(folder)
    cfg_file = folder / "config.json"
    top = read_config(folder)
    vllm, cfg = _layout(top)
    h, v = target.hidden_size, target.vocab_size
    expect(cfg, "hidden_size", h, cfg_file, "the target's hidden size")
    expect(cfg, "vocab_size", v, cfg_file, "the target's vocabulary")
    if config_int(cfg, "num_hidden_layers", cfg_file, default=1) != 1:
        raise SpeculatorLoadError(cfg_file, "num_hidden_layers", f"{cfg['num_hidden_layers']}: an EAGLE head has "
                                                                 f"one decoder layer")
    if vllm and cfg.get("skip_output_norm") is False:
        raise SpeculatorLoadError(cfg_file, "skip_output_norm", "false is not supported (EAGLE-1 heads have no "
                                                                "output norm)")
    input_norm = vllm and cfg.get("skip_prenorm") is False
    heads, kv, d, inter = decoder_layer_sizes(cfg, cfg_file, h)
    return Eagle1Config(top, vllm, cfg, input_norm, heads, kv, d, inter)


def load_eagle1(folder: Path, target: TargetInfo) -> tuple[EagleHead, DraftVocab]:
    """A published EAGLE-1/2 head (module docstring) as a float32 :class:`~.model.EagleHead` on the CPU, with its
    vocabulary (the target's whole one, or vLLM's ``token_map``), checked against the target.

    Raises:
        SpeculatorLoadError: naming the file and the key that does not fit: ``hidden_size``, ``vocab_size``,
            ``num_hidden_layers`` (one layer), a missing or misshapen weight, an unsupported option
            (``skip_output_norm: false``), ``token_map`` ids outside the target's vocabulary.
    """
    folder = Path(folder)
    cfg_file = folder / "config.json"
    c = check_eagle1_config(folder, target)
    top, vllm, cfg, input_norm = c.top, c.vllm, c.cfg, c.input_norm
    heads, kv, d, inter = c.heads, c.kv_heads, c.head_dim, c.intermediate
    h, v = target.hidden_size, target.vocab_size
    file = find_weights(folder)
    state = _normalise(load_weights(file))
    options = eagle1_options(top, set(state))
    fc_bias, qkv_bias, o_bias, para_norm = (options[k] for k in ("fc_bias", "qkv_bias", "o_bias", "para_norm"))
    why = f"hidden size {h}, {heads} heads of {d}, {kv} key/value heads, MLP {inter}"
    shapes = {"q_proj.weight": (heads * d, h), "k_proj.weight": (kv * d, h), "v_proj.weight": (kv * d, h),
              "o_proj.weight": (h, heads * d), "gate_proj.weight": (inter, h), "up_proj.weight": (inter, h),
              "down_proj.weight": (h, inter), "post_norm.weight": (h,)}
    weights = {mine: take(state, f"layers.0.{pub}", shapes[mine], file, why) for pub, mine in _LAYER.items()}
    weights["fc.weight"] = take(state, "fc.weight", (h, 2 * h), file, f"[embedding; hidden state] of hidden size {h}")
    if fc_bias:
        weights["fc.bias"] = take(state, "fc.bias", (h,), file, "the config asks for fc's bias")
    if qkv_bias:
        for p, rows in (("q", heads * d), ("k", kv * d), ("v", kv * d)):
            weights[f"{p}_proj.bias"] = take(state, f"layers.0.self_attn.{p}_proj.bias", (rows,), file,
                                             "the config asks for q/k/v biases (qkv_bias, attention_bias, qwen2)")
    if o_bias:
        weights["o_proj.bias"] = take(state, "layers.0.self_attn.o_proj.bias", (h,), file, "attention_bias true")
    if para_norm:
        for norm in ("enorm", "hnorm"):
            weights[f"{norm}.weight"] = take(state, f"{norm}.weight", (h,), file, "add_para_norm true (HASS)")
    if input_norm:
        weights["input_norm.weight"] = take(state, "layers.0.input_layernorm.weight", (h,), file, "skip_prenorm false")
    embedding = (take(state, "embed_tokens.weight", (v, h), file, f"the target's vocabulary {v} x hidden {h}")
                 if "embed_tokens.weight" in state else target.embeddings())
    n = config_int(top, "truncated_vocab_size", cfg_file, default=v) if vllm else v
    if "lm_head.weight" in state:
        rows = n if n == v or tuple(state["lm_head.weight"].shape) != (v, h) else v  # the whole one: sliced below
        head = take(state, "lm_head.weight", (rows, h), file, f"vocabulary {n} (or the target's {v}) x hidden {h}")
    else:
        if n != v:
            raise SpeculatorLoadError(file, "lm_head.weight",
                                      f"missing weight (a truncated vocabulary of {n} needs it)")
        head = target.lm_head()
    if n != v:
        token_ids = take(state, "token_map", (n,), file, "truncated_vocab_size").to(torch.int64) \
            if "token_map" in state else None
        if token_ids is None:
            raise SpeculatorLoadError(file, "token_map", f"missing weight (a truncated vocabulary of {n} needs it)")
        if token_ids.min() < 0 or token_ids.max() >= v or torch.unique(token_ids).numel() != n:
            raise SpeculatorLoadError(file, "token_map", f"ids must be distinct and lie in [0, {v})")
        if head.shape[0] == v:  # the target's whole LM head: the truncated vocabulary's rows
            head = head[token_ids]
    else:
        token_ids = torch.arange(v)
    config = {"num_attention_heads": heads, "num_key_value_heads": kv, "head_dim": d, "intermediate_size": inter,
              "rms_norm_eps": float(cfg.get("rms_norm_eps", 1e-6)),
              "rope_theta": float(cfg.get("rope_theta", 10000.0) or 10000.0),
              "rope_scaling": cfg.get("rope_scaling") or cfg.get("rope_parameters"),
              "max_position_embeddings": target.max_position_embeddings, "input_norm": input_norm, "fc_bias": fc_bias,
              "qkv_bias": qkv_bias, "o_bias": o_bias, "para_norm": para_norm}
    try:
        rope_inv_freq(config, d)
    except (ValueError, KeyError, TypeError) as e:
        raise SpeculatorLoadError(cfg_file, "rope_scaling", str(e)) from None
    model = EagleHead(embedding, head, config, embeds_target_ids=True)
    model.load_state_dict({**weights, "embedding": embedding, "head": head}, strict=True)
    return model.eval(), DraftVocab(token_ids, v)
