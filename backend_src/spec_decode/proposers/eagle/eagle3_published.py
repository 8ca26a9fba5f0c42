"""Published EAGLE-3 heads read into an :class:`~.eagle3.Eagle3Head` (:func:`load_eagle3`), their config checked
against the target first (:func:`check_eagle3_config`, also what the launcher checks before it starts:
:func:`~spec_decode.proposers.speculators.check_heads_fit`).

Two layouts: the EAGLE authors' (SafeAILab/EAGLE ``eagle/traineagle3``: ``midlayer.*``, sizes at the config's top;
:mod:`.eagle3` describes it) and the ``speculators`` library's (vllm-project/speculators ``Eagle3Speculator`` /
``Eagle3DraftModel``: sizes under ``transformer_layer_config``, weights ``layers.0.*``), as vLLM
(``model_executor/models/llama_eagle3.py``) and SGLang load them.
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
from ..speculators.layouts import eagle3_layer_ids
from ..speculators.target import TargetInfo
from .eagle3 import WEIGHT_NAMES, Eagle3Head
from .model import rope_inv_freq

_REFUSED_FLAGS = {  # config flags of variants whose computation this head does not implement -> why
    "fc_norm": "per-layer RMSNorms of each auxiliary state before fc (EAGLE 3.1) are not implemented here",
    "norm_output": "feeding the final-normed output back while drafting is not implemented here",
}


def _speculators_layout(cfg: dict) -> bool:
    """Whether the config is the ``speculators`` library's (``Eagle3Speculator`` / ``Eagle3DraftModel``, sizes under
    ``transformer_layer_config``)."""
    return cfg.get("speculators_model_type") == "eagle3" or isinstance(cfg.get("transformer_layer_config"), dict)


@dataclass(frozen=True)
class Eagle3Config:
    """An EAGLE-3 folder's config as :func:`check_eagle3_config` read it.

    Attributes:
        top: config.json as read. cfg: the dict holding the sizes (``transformer_layer_config`` in the
            ``speculators`` library's layout, else ``top``). speculators: whether that layout.
        hidden: H, the head's width. draft_vocab: N. heads, kv_heads, head_dim, intermediate: its attention and MLP
            sizes. layer_ids: the target layers ``fc`` reads, in its order (:func:`~spec_decode.proposers.
            speculators.eagle3_layer_ids`).
    """

    top: dict[str, Any]
    cfg: dict[str, Any]
    speculators: bool
    hidden: int
    draft_vocab: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    layer_ids: list[int]


def check_eagle3_config(folder: Path, target: TargetInfo) -> Eagle3Config:
    """An EAGLE-3 folder's ``config.json`` (either layout of :func:`load_eagle3`) checked against the target, without
    reading its weights: what :func:`load_eagle3` checks first, and the launcher before it starts anything
    (:func:`~spec_decode.proposers.speculators.check_heads_fit`).

    The target's hidden size is ``target_hidden_size`` when given (a head of another width: vLLM
    ``llama_eagle3.py``, the ``speculators`` library), else the head's ``hidden_size``; ``vocab_size`` is the
    target's vocabulary; one decoder layer; the auxiliary layer ids lie in the target's layers.

    Args:
        folder: the head's folder.
        target: the target it drafts for (its sizes).

    Returns:
        The sizes read (:class:`Eagle3Config`).

    Raises:
        SpeculatorLoadError: naming ``config.json`` and the key that does not fit: ``target_hidden_size`` /
            ``hidden_size``, ``vocab_size``, ``num_hidden_layers``, ``fc_norm`` or ``norm_output`` (variants not
            implemented), a missing or non-integer size, ``eagle_aux_hidden_state_layer_ids``.
    """
    folder = Path(folder)
    cfg_file = folder / "config.json"
    top = read_config(folder)
    speculators = _speculators_layout(top)
    cfg = top["transformer_layer_config"] if speculators and isinstance(top.get("transformer_layer_config"),
                                                                        dict) else top
    ht, v = target.hidden_size, target.vocab_size
    expect(top, "target_hidden_size", ht, cfg_file, "the target's hidden size")
    h = config_int(cfg, "hidden_size", cfg_file, default=ht)
    if top.get("target_hidden_size") is None:  # the head is the target's width
        expect(cfg, "hidden_size", ht, cfg_file, "the target's hidden size (no target_hidden_size given)")
    expect(cfg, "vocab_size", v, cfg_file, "the target's vocabulary")
    if config_int(cfg, "num_hidden_layers", cfg_file, default=1) != 1:
        raise SpeculatorLoadError(cfg_file, "num_hidden_layers", f"{cfg['num_hidden_layers']}: EAGLE-3 heads of more "
                                  f"than one decoder layer are not served here (their later layers would be dropped)")
    for flag, why in _REFUSED_FLAGS.items():
        if top.get(flag):
            raise SpeculatorLoadError(cfg_file, flag, f"true: {why}")
    n = config_int(top, "draft_vocab_size", cfg_file, default=v)
    heads, kv, d, inter = decoder_layer_sizes(cfg, cfg_file, h)
    ids = eagle3_layer_ids(top, target.num_layers, cfg_file)
    return Eagle3Config(top, cfg, speculators, h, n, heads, kv, d, inter, ids)


def load_eagle3(folder: Path, target: TargetInfo, aux_layers: list[int] | None = None) -> tuple[Eagle3Head, DraftVocab]:
    """An EAGLE-3 folder (module docstring) as a float32 :class:`Eagle3Head` on the CPU, and its draft vocabulary,
    checked against the target.

    Two layouts: the EAGLE authors' (``midlayer.*``, sizes at the config's top) and the ``speculators`` library's
    (vLLM's ``speculators`` project, e.g. RedHatAI's heads: ``Eagle3Speculator`` / ``Eagle3DraftModel``, sizes under
    ``transformer_layer_config``, weights ``layers.0.*``, ``fc.bias``). Variants: ``target_hidden_size`` (the head
    narrower or wider than the target: ``fc`` over 3 x the target's width, its own ``embed_tokens.weight``),
    ``norm_before_residual``, ``norm_before_fc`` (``input_norm.weight`` over the concatenated states),
    ``attention_bias``, ``fc.bias``; ids of layer L (the last layer's output) and the output-of-layer convention
    (:func:`~spec_decode.proposers.speculators.eagle3_layer_ids`).

    Args:
        folder: the head's folder.
        target: the target it drafts for (sizes; its embedding when the folder has none).
        aux_layers: the layers the target returns, in the wire's order (:func:`~spec_decode.proposers.speculators.
            aux_hidden_state_layers`); default: this head's own.

    Raises:
        SpeculatorLoadError: naming the file and the key that does not fit: ``hidden_size`` / ``target_hidden_size``,
            ``vocab_size``, ``draft_vocab_size``, ``num_hidden_layers`` (one layer), a missing or misshapen weight,
            ``d2t`` ids outside the target's vocabulary, ``eagle_aux_hidden_state_layer_ids``, an unsupported
            ``rope_scaling``, ``fc_norm`` or ``norm_output`` (variants not implemented).
    """
    folder = Path(folder)
    cfg_file = folder / "config.json"
    c = check_eagle3_config(folder, target)
    top, cfg, speculators, ids = c.top, c.cfg, c.speculators, c.layer_ids
    h, n, heads, kv, d, inter = c.hidden, c.draft_vocab, c.heads, c.kv_heads, c.head_dim, c.intermediate
    ht, v = target.hidden_size, target.vocab_size
    wire = aux_layers if aux_layers is not None else sorted(set(ids))
    file = find_weights(folder)
    state = load_weights(file)
    if speculators:  # the same tensors under the speculators library's names
        state = {("midlayer." + k[len("layers.0."):] if k.startswith("layers.0.") else k): t for k, t in state.items()}
    # attention_bias: q/k/v/o biases (the speculators library's); a bias in the file is used even unnamed (trained)
    qkv_bias = bool(cfg.get("attention_bias", False)) or "midlayer.self_attn.q_proj.bias" in state
    o_bias = bool(cfg.get("attention_bias", False)) or "midlayer.self_attn.o_proj.bias" in state
    norm_before_fc = bool(top.get("norm_before_fc", False))
    why = f"hidden size {h}, {heads} heads of {d}, {kv} key/value heads, MLP {inter}, {len(ids)} target layers"
    shapes = {"fc.weight": (h, len(ids) * ht), "midlayer.input_layernorm.weight": (h,),
              "midlayer.hidden_norm.weight": (h,), "midlayer.post_attention_layernorm.weight": (h,),
              "midlayer.self_attn.q_proj.weight": (heads * d, 2 * h),
              "midlayer.self_attn.k_proj.weight": (kv * d, 2 * h), "midlayer.self_attn.v_proj.weight": (kv * d, 2 * h),
              "midlayer.self_attn.o_proj.weight": (h, heads * d), "midlayer.mlp.gate_proj.weight": (inter, h),
              "midlayer.mlp.up_proj.weight": (inter, h), "midlayer.mlp.down_proj.weight": (h, inter),
              "norm.weight": (h,), "lm_head.weight": (n, h)}
    weights = {mine: take(state, pub, shapes[pub], file, why) for pub, mine in WEIGHT_NAMES.items()}
    if "fc.bias" in state:
        weights["fc.bias"] = take(state, "fc.bias", (h,), file, why)
    for p, rows, used in (("q", heads * d, qkv_bias), ("k", kv * d, qkv_bias), ("v", kv * d, qkv_bias),
                          ("o", h, o_bias)):
        if used:
            weights[f"{p}_proj.bias"] = take(state, f"midlayer.self_attn.{p}_proj.bias", (rows,), file,
                                             "attention_bias true, or the file's q/k/v biases")
    if norm_before_fc:
        weights["fc_input_norm.weight"] = take(state, "input_norm.weight", (len(ids) * ht,), file,
                                               "norm_before_fc true: an RMSNorm over the concatenated target states")
    if "d2t" in state:
        d2t = state["d2t"].to(torch.int64).reshape(-1)
        if d2t.numel() != n:
            raise SpeculatorLoadError(file, "d2t", f"{d2t.numel()} offsets, expected draft_vocab_size {n}")
        token_ids = torch.arange(n) + d2t
    elif n == v:
        token_ids = torch.arange(v)
    else:
        raise SpeculatorLoadError(file, "d2t", f"missing weight (a draft vocabulary of {n} < {v} tokens needs it)")
    if token_ids.min() < 0 or token_ids.max() >= v or torch.unique(token_ids).numel() != n:
        raise SpeculatorLoadError(file, "d2t", f"maps the draft vocabulary outside the target's [0, {v}) or onto "
                                               f"one token twice")
    if "embed_tokens.weight" in state or h != ht:
        embedding = take(state, "embed_tokens.weight", (v, h), file,
                         f"vocabulary {v} x the head's hidden size {h}" + (" (the target's embedding is narrower or "
                                                                            "wider: the head needs its own)" if h != ht
                                                                           else ""))
    else:
        embedding = target.embeddings()
    config = {"hidden_size": h, "num_attention_heads": heads, "num_key_value_heads": kv, "head_dim": d,
              "intermediate_size": inter, "rms_norm_eps": float(cfg.get("rms_norm_eps", 1e-5)),
              "draft_vocab_size": n, "rope_theta": float(cfg.get("rope_theta", 10000.0) or 10000.0),
              "rope_scaling": cfg.get("rope_scaling") or cfg.get("rope_parameters"),
              "max_position_embeddings": target.max_position_embeddings, "target_hidden_size": ht,
              "fc_bias": "fc.bias" in weights, "qkv_bias": qkv_bias, "o_bias": o_bias, "norm_before_fc": norm_before_fc,
              "norm_before_residual": bool(top.get("norm_before_residual", cfg.get("norm_before_residual", False)))}
    try:
        rope_inv_freq(config, d)
    except (ValueError, KeyError, TypeError) as e:
        raise SpeculatorLoadError(cfg_file, "rope_scaling", str(e)) from None
    missing = [i for i in ids if i not in wire]
    if missing:
        raise SpeculatorLoadError(cfg_file, "eagle_aux_hidden_state_layer_ids",
                                  f"layers {missing} are not among those the target returns ({wire})")
    model = Eagle3Head(embedding, config, len(ids), [1 + wire.index(i) for i in ids])
    model.load_state_dict({**weights, "embedding": embedding})
    return model.eval(), DraftVocab(token_ids, v)
