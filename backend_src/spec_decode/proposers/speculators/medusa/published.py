"""Published Medusa heads read into a :class:`~.model.MedusaHead` (:func:`load_medusa`): FasterDecoding's layout and
vLLM's conversion (the package's docstring describes both), their config read and checked first by :mod:`.config`."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from ..checkpoint import SpeculatorLoadError, find_weights, load_weights, take
from ..target import TargetInfo
from .config import (
    FASTER_DECODING_FILES,
    MedusaConfig,
    check_config_sizes,
    check_medusa_config,
    faster_decoding_heads,
    faster_decoding_shapes,
    sharded_index,
    strip_prefix,
)
from .model import MedusaHead

VLLM_FILES = ("model.safetensors", "pytorch_model.bin")  # vLLM's converted checkpoints


def _set(linear: nn.Module, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
    """Copy a loaded weight (and bias) into ``linear``."""
    with torch.no_grad():
        linear.weight.copy_(weight)  # type: ignore[operator]
        if bias is not None:
            linear.bias.copy_(bias)  # type: ignore[operator]


def _token_map(state: dict[str, torch.Tensor], size: int, vocab: int, file: Path) -> torch.Tensor:
    """vLLM's ``token_map`` weight: [size] int64 distinct ids in [0, vocab).

    Raises:
        SpeculatorLoadError: missing, or another shape, or ids that are not distinct integers in range.
    """
    t = take(state, "token_map", (size,), file, f"truncated_vocab_size {size}")
    raw = state["token_map"]
    integral = not raw.is_floating_point() or torch.equal(raw, raw.round())
    if not integral or (size and (t.min() < 0 or t.max() >= vocab)) or len(torch.unique(t)) != size:
        raise SpeculatorLoadError(file, "token_map", f"must hold {size} distinct token ids in [0, {vocab})")
    return raw.long()


def _sharded_heads(folder: Path) -> tuple[Path, dict[str, torch.Tensor]] | None:
    """A Medusa-2 full model's heads (:func:`sharded_index`): only the ``medusa_head.*`` tensors, read from the
    shards the index names for them; None when the folder has no index.

    Raises:
        SpeculatorLoadError: an index that names no ``medusa_head.`` weight, or is unreadable; an unreadable shard.
    """
    found = sharded_index(folder)
    if found is None:
        return None
    index, shards = found
    state: dict[str, torch.Tensor] = {}
    for shard in shards:
        state.update(load_weights(folder / shard, "medusa_head."))
    return index, state


def _target_lm_head(target: TargetInfo) -> torch.Tensor:
    """The target's LM head [V, H], for heads projected by it (vLLM's ``original_lm_head``, Medusa version 2).

    Raises:
        SpeculatorLoadError: it is not [V, H] of the target's sizes.
    """
    lm = target.lm_head()
    v, h = target.vocab_size, target.hidden_size
    if tuple(lm.shape) != (v, h):
        raise SpeculatorLoadError(target.path or "target", "lm_head.weight",
                                  f"shape {list(lm.shape)}, expected [{v}x{h}] (the target's sizes)")
    return lm


def _load_faster_decoding(folder: Path, c: MedusaConfig, target: TargetInfo) -> MedusaHead:
    """FasterDecoding's layout (see the module docstring), checked against ``target``.

    Its variants: a file holding more heads than ``medusa_num_heads`` says serves them all (``FasterDecoding/
    medusa-vicuna-7b-v1.3``'s config says 2 and its file holds 5: the authors' ``MedusaModel.from_pretrained``
    forces 5, "TODO: fix the uploaded config"); ``version: "2"`` heads (``medusa/train/train_legacy.py``, TGI's
    ``MedusaHeadV2``) hold the residual blocks only and are projected by the target's own LM head; a Medusa-2 full
    model (sharded, with an index) serves the ``medusa_head.*`` weights out of it."""
    layers = c.num_layers
    h, v = target.hidden_size, target.vocab_size
    sharded = None if any((folder / f).is_file() for f in FASTER_DECODING_FILES) else _sharded_heads(folder)
    if sharded is not None:
        file, state = sharded[0], strip_prefix(sharded[1], "medusa_head.")
    else:
        file = find_weights(folder, FASTER_DECODING_FILES)
        state = strip_prefix(load_weights(file), "medusa_head.")
    n, v2 = faster_decoding_heads(c, state)
    head = MedusaHead(h, v, n, layers, bias=True, shared_lm_head=v2)
    weights = {key: take(state, key, shape, file, why)
               for key, (shape, why) in faster_decoding_shapes(n, layers, v2, target).items()}
    for i in range(n):
        for j in range(layers):
            _set(head.blocks[i][j], weights[f"{i}.{j}.linear.weight"],  # type: ignore[index]
                 weights[f"{i}.{j}.linear.bias"])
        if not v2:
            _set(head.lm_heads[i], weights[f"{i}.{layers}.weight"])
    if v2:  # residual blocks projected by the base model's LM head
        _set(head.lm_heads[0], _target_lm_head(target))
    check_config_sizes(c, target)
    return head


def _load_vllm(folder: Path, c: MedusaConfig, target: TargetInfo) -> MedusaHead:
    """vLLM's converted layout (see the module docstring), checked against ``target``."""
    cfg, n, layers, cfg_vocab, truncated, scale = c.cfg, c.num_heads, c.num_layers, c.vocab, c.truncated, c.logit_scale
    h, v = target.hidden_size, target.vocab_size
    file = find_weights(folder, VLLM_FILES)
    state = strip_prefix(load_weights(file), "medusa_heads.")
    bias = cfg.get("medusa_fc_bias")
    if not isinstance(bias, bool):  # unset: the biases are read when the conversion kept them
        bias = any(k.startswith("blocks.") and k.endswith(".bias") for k in state)
    token_map = _token_map(state, truncated, v, file) if truncated < cfg_vocab else None
    shared = bool(cfg.get("original_lm_head", False))
    head = MedusaHead(h, v, n, layers, bias, shared, token_map, float(scale))
    hidden_why = f"the target's hidden size {h}"
    for i in range(n):
        for j in range(layers):
            key = f"blocks.{i}.layers.{j}"
            _set(head.blocks[i][j], take(state, f"{key}.weight", (h, h), file, hidden_why),  # type: ignore[index]
                 take(state, f"{key}.bias", (h,), file, hidden_why) if bias else None)

    def projection(key: str) -> torch.Tensor:
        # [truncated, H]; a full [V, H] one is cut to the token map's rows, as vLLM does
        full = token_map is not None and key in state and state[key].ndim == 2 and state[key].shape[0] == v
        why = f"the target's hidden size {h}, vocabulary {v}" + ("" if token_map is None else f", truncated to "
                                                                                            f"{truncated}")
        t = take(state, key, (v if full or token_map is None else truncated, h), file, why)
        return t[token_map] if full and token_map is not None else t

    if shared:  # vLLM loads lm_heads.0.weight as the shared head when the file has one; else it is the target's
        if "lm_heads.0.weight" in state:
            lm = projection("lm_heads.0.weight")
        else:
            lm = _target_lm_head(target)
            lm = lm if token_map is None else lm[token_map]
        _set(head.lm_heads[0], lm)
    else:
        for i in range(n):
            _set(head.lm_heads[i], projection(f"lm_heads.{i}.weight"))
    check_config_sizes(c, target)
    return head


def load_medusa(folder: Path | str, target: TargetInfo) -> MedusaHead:
    """The Medusa head in ``folder`` (FasterDecoding's layout or vLLM's conversion, told apart by ``config.json``),
    float32 on the CPU, checked against the target.

    Follows FasterDecoding/Medusa ``medusa/model/medusa_model.py`` (``MedusaConfig``, ``ResBlock``,
    ``MedusaModel.from_pretrained``: ``medusa_lm_head.pt``, and the trainer's ``medusa_lm_head.safetensors``) and
    vLLM ``vllm/model_executor/models/medusa.py`` (``Medusa.load_weights``) with
    ``vllm/transformers_utils/configs/medusa.py`` (``MedusaConfig``).

    Args:
        folder: the head's folder.
        target: the target it drafts for: its hidden size H and vocabulary V, and its LM head when vLLM's
            ``original_lm_head`` heads come without one.

    Returns:
        A :class:`MedusaHead` in eval mode, without gradients.

    Raises:
        SpeculatorLoadError: naming the file and the key: no ``config.json``, or neither layout
            (``medusa_num_heads``); a count that is missing or not an integer (``medusa_num_heads``, ``num_heads``,
            ``medusa_num_layers``, ...); a weight missing or of another shape than H and V make it (e.g.
            ``0.0.linear.weight`` for another hidden size, ``0.1.weight`` / ``lm_heads.0.weight`` for another
            vocabulary); config sizes that are not the target's (``hidden_size``, ``vocab_size``); an unreadable
            weights file (``weights``).
    """
    folder = Path(folder)
    c = check_medusa_config(folder, target)
    loader = _load_vllm if c.layout == "vllm" else _load_faster_decoding
    return loader(folder, c, target).requires_grad_(False).eval()
