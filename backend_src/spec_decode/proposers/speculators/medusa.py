"""Published Medusa heads (``speculative_method=medusa``): the head, its two published layouts, and the proposer.

Medusa (Cai et al. 2024, FasterDecoding/Medusa) puts n small heads on the target's last hidden state h_t (after the
final norm, the state whose LM head gives token t+1); head i predicts token t+2+i. Head i is L residual blocks
``x <- x + SiLU(W x + b)`` followed by a projection to the vocabulary. In this server's terms (:class:`MedusaProposer`)
the state that predicted the last committed token drafts the next ones: head i drafts slot i.

Two layouts are published (:func:`load_medusa` tells them apart from ``config.json``):

* FasterDecoding's (``medusa/model/medusa_model.py``, ``medusa/train``): ``config.json`` with ``medusa_num_heads``,
  ``medusa_num_layers``, ``base_model_name_or_path``; weights ``medusa_lm_head.safetensors`` or ``medusa_lm_head.pt``,
  the ``state_dict`` of an ``nn.ModuleList`` of ``nn.Sequential(ResBlock x L, Linear(H, V, bias=False))``: names
  ``{i}.{j}.linear.weight`` / ``{i}.{j}.linear.bias`` and ``{i}.{L}.weight``. (Its heads repeat one ResBlock L times,
  so its files hold L copies of the same block; each copy is read as its own block, which is the same maths.)
  Its variants (:func:`_load_faster_decoding`): a file with more heads than ``medusa_num_heads`` says serves them all
  (``FasterDecoding/medusa-vicuna-7b-v1.3``); ``version: "2"`` (``medusa/train/train_legacy.py``, TGI's
  ``MedusaHeadV2``) holds the blocks only, projected by the target's LM head; a Medusa-2 full model
  (``FasterDecoding/medusa-1.0-*``) serves the ``medusa_head.*`` weights out of its shards.
* vLLM's conversion (``vllm/model_executor/models/medusa.py``, ``vllm/transformers_utils/configs/medusa.py``):
  ``config.json`` with ``architectures: [MedusaModel]`` / ``model_type: medusa``, ``num_heads``,
  ``num_hidden_layers``, ``hidden_size``, ``vocab_size``, optional ``truncated_vocab_size`` (with a ``token_map``
  weight), ``original_lm_head``, ``medusa_fc_bias``, ``logit_scale``; names ``blocks.{i}.layers.{j}.weight`` /
  ``.bias`` and ``lm_heads.{i}.weight`` (a ``medusa_heads.`` prefix is dropped, as vLLM does).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar, cast

import torch
import torch.nn.functional as F
from torch import nn

from ...sampling import NoisePurpose
from ..base import Proposal, ProposalRequest, confident, draft_token
from .base import HeadProposer
from .checkpoint import (
    CONFIG_FILE,
    SpeculatorLoadError,
    check_shape,
    config_int,
    expect,
    find_weights,
    load_weights,
    read_config,
    take,
    weight_shapes,
)
from .target import TargetInfo

logger = logging.getLogger(__name__)
T = TypeVar("T")

FASTER_DECODING_FILES = ("medusa_lm_head.safetensors", "medusa_lm_head.pt")  # FasterDecoding's weights file names
VLLM_FILES = ("model.safetensors", "pytorch_model.bin")  # vLLM's converted checkpoints


class MedusaHead(nn.Module):
    """n Medusa heads over the target's last hidden state.

    Head i: ``num_layers`` residual blocks ``x <- x + SiLU(Linear(x))`` (FasterDecoding's ``ResBlock``, vLLM's
    ``ResidualBlock``), then a projection to the vocabulary without bias (its own, or one shared by every head: vLLM's
    ``original_lm_head``). With a ``token_map`` (vLLM's ``truncated_vocab_size``) the projection covers only the
    mapped ids and every other id gets -inf.

    Args:
        hidden_size: H.
        vocab_size: V, the target's vocabulary.
        num_heads: n >= 1.
        num_layers: residual blocks per head, L >= 0.
        bias: whether the blocks' linears have a bias (FasterDecoding: always; vLLM: ``medusa_fc_bias``).
        shared_lm_head: one projection for every head (``original_lm_head``).
        token_map: [V'] int64 distinct ids in [0, V) the projections' rows stand for, or None (V' = V).
        logit_scale: factor on the logits (vLLM's ``logit_scale``; 1.0 otherwise).

    Weights are zero-initialised: :func:`load_medusa` fills them.
    """

    def __init__(self, hidden_size: int, vocab_size: int, num_heads: int, num_layers: int, bias: bool = True,
                 shared_lm_head: bool = False, token_map: torch.Tensor | None = None, logit_scale: float = 1.0):
        super().__init__()
        self.hidden_size, self.vocab_size, self.num_heads, self.num_layers = hidden_size, vocab_size, num_heads, \
            num_layers
        self.logit_scale = float(logit_scale)
        rows = vocab_size if token_map is None else len(token_map)
        self.blocks = nn.ModuleList(nn.ModuleList(nn.Linear(hidden_size, hidden_size, bias=bias)
                                                  for _ in range(num_layers)) for _ in range(num_heads))
        self.lm_heads = nn.ModuleList(nn.Linear(hidden_size, rows, bias=False)
                                      for _ in range(1 if shared_lm_head else num_heads))
        self.token_map: torch.Tensor | None
        self.register_buffer("token_map", None if token_map is None else token_map.long().clone())
        for p in self.parameters():
            nn.init.zeros_(p)

    def forward(self, states: torch.Tensor, heads: int | None = None) -> torch.Tensor:
        """The heads' logits.

        Args:
            states: [B, H] the target's last hidden states (any float dtype and device; moved to the head's).
            heads: compute only the first ``heads`` heads (None: all n).

        Returns:
            [heads, B, V] float32 logits on the head's device (-inf at the ids a ``token_map`` leaves out).
        """
        ref = next(self.lm_heads.parameters())
        x0 = states.to(device=ref.device, dtype=ref.dtype)
        out = []
        for i in range(self.num_heads if heads is None else min(heads, self.num_heads)):
            x = x0
            for linear in cast(nn.ModuleList, self.blocks[i]):
                x = x + F.silu(linear(x))
            logits = self.lm_heads[0 if len(self.lm_heads) == 1 else i](x).float()
            if self.logit_scale != 1.0:
                logits = logits * self.logit_scale
            if self.token_map is not None:
                full = logits.new_full((logits.shape[0], self.vocab_size), float("-inf"))
                full[:, self.token_map] = logits
                logits = full
            out.append(logits)
        return torch.stack(out)


def _strip(state: dict[str, T], prefix: str) -> dict[str, T]:
    """The weights with ``prefix`` dropped from the names that start with it."""
    return {k[len(prefix):] if k.startswith(prefix) else k: v for k, v in state.items()}


def _set(linear: nn.Module, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
    """Copy a loaded weight (and bias) into ``linear``."""
    with torch.no_grad():
        linear.weight.copy_(weight)  # type: ignore[operator]
        if bias is not None:
            linear.bias.copy_(bias)  # type: ignore[operator]


def _layout(cfg: dict[str, Any]) -> str | None:
    """``vllm`` (vLLM's ``MedusaModel`` conversion), ``medusa`` (FasterDecoding's ``medusa_num_heads``), or None."""
    archs = cfg.get("architectures") or []
    archs = [str(a) for a in archs] if isinstance(archs, list) else [str(archs)]
    if "MedusaModel" in archs or cfg.get("model_type") == "medusa":
        return "vllm"
    return "medusa" if "medusa_num_heads" in cfg else None


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


def _sharded_index(folder: Path) -> tuple[Path, list[str]] | None:
    """A Medusa-2 full model's index (FasterDecoding/medusa-1.0-*: the base model and ``medusa_head.*`` in sharded
    ``model-*.safetensors`` / ``pytorch_model-*.bin`` files under an index) and the shards it names for the
    ``medusa_head.*`` weights; None when the folder has no index.

    Raises:
        SpeculatorLoadError: an index that names no ``medusa_head.`` weight, or is unreadable.
    """
    import json

    for index_name in ("model.safetensors.index.json", "pytorch_model.bin.index.json"):
        index = folder / index_name
        if not index.is_file():
            continue
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise SpeculatorLoadError(index, "weight_map", f"unreadable ({e})") from None
        shards = sorted({f for k, f in weight_map.items() if k.startswith("medusa_head.")})
        if not shards:
            raise SpeculatorLoadError(index, "medusa_head.", "no Medusa head weight in this model's index (a full "
                                                             "model without Medusa heads)")
        return index, shards
    return None


def _sharded_heads(folder: Path) -> tuple[Path, dict[str, torch.Tensor]] | None:
    """A Medusa-2 full model's heads (:func:`_sharded_index`): only the ``medusa_head.*`` tensors, read from the
    shards the index names for them; None when the folder has no index.

    Raises:
        SpeculatorLoadError: an index that names no ``medusa_head.`` weight, or is unreadable; an unreadable shard.
    """
    found = _sharded_index(folder)
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


def _heads_in_file(state: Mapping[str, Any]) -> int:
    """How many heads FasterDecoding's names (the keys of ``state``: ``{i}.0.linear.weight``, ``{i}.{L}.weight``)
    hold: 1 + the largest i."""
    ids = [int(k.split(".", 1)[0]) for k in state if k.split(".", 1)[0].isdigit()]
    return 1 + max(ids) if ids else 0


@dataclass(frozen=True)
class MedusaConfig:
    """A Medusa folder's config as :func:`check_medusa_config` read it.

    Attributes:
        file: its ``config.json``. cfg: the config as read. layout: ``medusa`` (FasterDecoding's) or ``vllm``.
        num_heads: n as the config says (FasterDecoding's files may hold more: :func:`load_medusa`).
        num_layers: residual blocks per head.
        vocab: vLLM's ``vocab_size`` (the target's when absent; compared with it after the weights), else the
            target's. truncated: vLLM's ``truncated_vocab_size`` (``vocab`` when absent).
        logit_scale: vLLM's ``logit_scale`` (1.0 otherwise).
    """

    file: Path
    cfg: dict[str, Any]
    layout: str
    num_heads: int
    num_layers: int
    vocab: int
    truncated: int
    logit_scale: float


def check_medusa_config(folder: Path | str, target: TargetInfo) -> MedusaConfig:
    """A Medusa folder's ``config.json`` read and checked before its weights, as :func:`load_medusa` does first: its
    layout (FasterDecoding's ``medusa_num_heads``, or vLLM's ``MedusaModel``), the heads' and blocks' counts, and in
    vLLM's layout ``truncated_vocab_size`` <= ``vocab_size`` and a finite ``logit_scale`` (FasterDecoding/Medusa
    ``MedusaConfig``; vLLM ``transformers_utils/configs/medusa.py``).

    The config's sizes are compared with the target's after the weights (whose errors name the weight), by
    :func:`load_medusa` and by :func:`check_medusa_fit`.

    Args:
        folder: the head's folder.
        target: the target it drafts for (its vocabulary, vLLM's default ``vocab_size``).

    Raises:
        SpeculatorLoadError: naming ``config.json`` and the key: neither layout (``medusa_num_heads``), a count that
            is missing or not an integer (``medusa_num_heads``, ``num_heads``, ``medusa_num_layers``, ...),
            ``truncated_vocab_size``, ``logit_scale``.
    """
    folder = Path(folder)
    cfg_file = folder / CONFIG_FILE
    cfg = read_config(folder)
    layout = _layout(cfg)
    if layout is None:
        raise SpeculatorLoadError(cfg_file, "medusa_num_heads",
                                  "missing from config.json: neither FasterDecoding's Medusa config "
                                  "(medusa_num_heads) nor vLLM's (architectures: MedusaModel)")
    v = target.vocab_size
    if layout == "medusa":
        n = config_int(cfg, "medusa_num_heads", cfg_file)
        layers = config_int(cfg, "medusa_num_layers", cfg_file, default=1, low=0)
        return MedusaConfig(cfg_file, cfg, layout, n, layers, v, v, 1.0)
    n = config_int(cfg, "num_heads" if "num_heads" in cfg or "medusa_num_heads" not in cfg else "medusa_num_heads",
                   cfg_file)
    layers = config_int(cfg, "num_hidden_layers", cfg_file, default=1, low=0)
    cfg_vocab = config_int(cfg, "vocab_size", cfg_file, default=v)  # compared with the target's after the weights
    truncated = config_int(cfg, "truncated_vocab_size", cfg_file, default=cfg_vocab)
    if truncated > cfg_vocab:
        raise SpeculatorLoadError(cfg_file, "truncated_vocab_size", f"{truncated} exceeds vocab_size ({cfg_vocab})")
    scale = cfg.get("logit_scale", 1.0)
    if scale is None:
        scale = 1.0
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale):
        raise SpeculatorLoadError(cfg_file, "logit_scale", f"must be a finite number, got {scale!r}")
    return MedusaConfig(cfg_file, cfg, layout, n, layers, cfg_vocab, truncated, float(scale))


def _faster_decoding_weight_shapes(folder: Path) -> tuple[Path, dict[str, tuple[int, ...]]] | None:
    """FasterDecoding's weights' (file, name -> shape) without reading their data (:func:`~.checkpoint.
    weight_shapes`; a Medusa-2 full model's ``medusa_head.*`` from the shards its index names, the file then being
    the index), names without ``medusa_head.``; None when a pickle cannot be read so (the legacy format).

    Raises:
        SpeculatorLoadError: no weights file, an unreadable index or file.
    """
    sharded = None if any((folder / f).is_file() for f in FASTER_DECODING_FILES) else _sharded_index(folder)
    files = [folder / shard for shard in sharded[1]] if sharded is not None else \
        [find_weights(folder, FASTER_DECODING_FILES)]
    shapes: dict[str, tuple[int, ...]] = {}
    for file in files:
        found = weight_shapes(file)
        if found is None:
            return None
        shapes.update({k: t for k, t in found.items() if sharded is None or k.startswith("medusa_head.")})
    return (sharded[0] if sharded is not None else files[0]), _strip(shapes, "medusa_head.")


def _faster_decoding_heads(c: MedusaConfig, names: Mapping[str, Any], warn: bool = True) -> tuple[int, bool]:
    """(the number of heads served, whether they are version 2) of FasterDecoding's layout, from its config and its
    weights' names (the keys of ``names``): a file holding more heads than ``medusa_num_heads`` says serves them all
    (logged when ``warn``); version 2 when the config says ``version: "2"`` (TGI reads it) or the file holds blocks
    without any projection."""
    n, layers = c.num_heads, c.num_layers
    found = _heads_in_file(names)
    if found > n:
        if warn:
            logger.warning("%s: medusa_num_heads is %d but the file holds %d heads: serving %d (as the Medusa authors "
                           "do for heads whose uploaded config is wrong)", c.file, n, found, found)
        n = found
    v2 = str(c.cfg.get("version", "")) == "2" or (layers > 0 and not any(f"{i}.{layers}.weight" in names
                                                                          for i in range(n)))
    return n, v2


def _faster_decoding_shapes(n: int, layers: int, v2: bool, target: TargetInfo
                            ) -> dict[str, tuple[tuple[int, ...], str]]:
    """Name -> (shape, what it comes from) of FasterDecoding's weights for ``n`` heads of ``layers`` blocks over the
    target, in the order the loader reads them: per head its blocks' ``{i}.{j}.linear.weight`` [H, H] and ``.bias``
    [H], then its projection ``{i}.{L}.weight`` [V, H] (none in version 2)."""
    h, v = target.hidden_size, target.vocab_size
    hidden_why, vocab_why = f"the target's hidden size {h}", f"the target's vocabulary {v} x hidden size {h}"
    out: dict[str, tuple[tuple[int, ...], str]] = {}
    for i in range(n):
        for j in range(layers):
            out[f"{i}.{j}.linear.weight"] = (h, h), hidden_why
            out[f"{i}.{j}.linear.bias"] = (h,), hidden_why
        if not v2:
            out[f"{i}.{layers}.weight"] = (v, h), vocab_why
    return out


def _check_config_sizes(c: MedusaConfig, target: TargetInfo) -> None:
    """The config's ``hidden_size`` and ``vocab_size``, when it has them (vLLM's conversion, a Medusa-2 full model's
    base config), against the target's: the loaders compare them after the weights, whose errors name the weight.

    Raises:
        SpeculatorLoadError: naming ``config.json`` and the key.
    """
    expect(c.cfg, "hidden_size", target.hidden_size, c.file, "the target's hidden size")
    expect(c.cfg, "vocab_size", target.vocab_size, c.file, "the target's vocabulary size")


def check_medusa_fit(folder: Path | str, target: TargetInfo) -> MedusaConfig:
    """A Medusa folder checked against the target without reading its weights' data: :func:`check_medusa_config`,
    then the sizes :func:`load_medusa` checks once it has the weights, from the weights' shapes (FasterDecoding's
    layout, whose config has no sizes: the blocks [H, H] and projections [V, H] of the weights file's header, or of a
    memory-mapped pickle; skipped for a legacy-format pickle) and the config's ``hidden_size`` / ``vocab_size`` (vLLM's
    conversion, a Medusa-2 full model's base config). What the launcher checks before it starts anything
    (:func:`~spec_decode.proposers.speculators.check_heads_fit`).

    A weight the file lacks is left to the loader (naming it); the target's own LM head (version 2, vLLM's
    ``original_lm_head``) is not read.

    Raises:
        SpeculatorLoadError: as :func:`load_medusa`, naming the file and the key that does not fit.
    """
    folder = Path(folder)
    c = check_medusa_config(folder, target)
    found = _faster_decoding_weight_shapes(folder) if c.layout == "medusa" else None
    if found is not None:
        file, shapes = found
        n, v2 = _faster_decoding_heads(c, shapes, warn=False)
        for key, (shape, why) in _faster_decoding_shapes(n, c.num_layers, v2, target).items():
            if key in shapes:
                check_shape(shapes[key], key, shape, file, why)
    _check_config_sizes(c, target)
    return c


def medusa_weight_sizes(folder: Path | str) -> tuple[int | None, int | None]:
    """(hidden size, vocabulary) FasterDecoding's Medusa weights in ``folder`` are made for, from their shapes (head
    0's first block [H, H], its projection [V, H]; :func:`~.checkpoint.weight_shapes`), for messages: None where the
    file does not say (vLLM's layout, version 2's missing projection, a legacy pickle, an unreadable folder). Never
    raises."""
    try:
        cfg = read_config(Path(folder))
        layers = cfg.get("medusa_num_layers", 1)
        found = _faster_decoding_weight_shapes(Path(folder)) if _layout(cfg) == "medusa" else None
    except (SpeculatorLoadError, OSError):
        return None, None
    if found is None:
        return None, None
    shapes = found[1]
    block, proj = shapes.get("0.0.linear.weight"), shapes.get(f"0.{layers}.weight")
    return (block[0] if block and len(block) == 2 else proj[1] if proj and len(proj) == 2 else None,
            proj[0] if proj and len(proj) == 2 else None)


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
        file, state = sharded[0], _strip(sharded[1], "medusa_head.")
    else:
        file = find_weights(folder, FASTER_DECODING_FILES)
        state = _strip(load_weights(file), "medusa_head.")
    n, v2 = _faster_decoding_heads(c, state)
    head = MedusaHead(h, v, n, layers, bias=True, shared_lm_head=v2)
    weights = {key: take(state, key, shape, file, why)
               for key, (shape, why) in _faster_decoding_shapes(n, layers, v2, target).items()}
    for i in range(n):
        for j in range(layers):
            _set(head.blocks[i][j], weights[f"{i}.{j}.linear.weight"],  # type: ignore[index]
                 weights[f"{i}.{j}.linear.bias"])
        if not v2:
            _set(head.lm_heads[i], weights[f"{i}.{layers}.weight"])
    if v2:  # residual blocks projected by the base model's LM head
        _set(head.lm_heads[0], _target_lm_head(target))
    _check_config_sizes(c, target)
    return head


def _load_vllm(folder: Path, c: MedusaConfig, target: TargetInfo) -> MedusaHead:
    """vLLM's converted layout (see the module docstring), checked against ``target``."""
    cfg, n, layers, cfg_vocab, truncated, scale = c.cfg, c.num_heads, c.num_layers, c.vocab, c.truncated, c.logit_scale
    h, v = target.hidden_size, target.vocab_size
    file = find_weights(folder, VLLM_FILES)
    state = _strip(load_weights(file), "medusa_heads.")
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
    _check_config_sizes(c, target)
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


class MedusaProposer(HeadProposer):
    """Drafts with published Medusa heads (``speculative_method=medusa``; vLLM's ``MedusaProposer``, FasterDecoding's
    top-1 candidates).

    A round's requests share one forward of the heads over their last hidden states (the state that predicted the
    last committed token): head i's distribution, after the request's processors and sampling transforms
    (:func:`~spec_decode.proposers.base.draft_token`), proposes slot i, and the draft is its argmax. Medusa's drafts
    are deterministic, so proposals carry no ``draft_probs`` (the verifier takes q one-hot, which keeps rejection
    sampling exact). A request drafts up to min(k, n) slots and stops at the first slot that fails
    :func:`~spec_decode.proposers.base.confident`; its score is the sum of its drafts' running probabilities. A
    request without hidden states (its first step) gets no drafts. The heads keep no per-sequence state.

    Args:
        head: a :class:`MedusaHead` (on its device and dtype).
        hidden_size: H, the target's hidden size.
        settings: the :class:`~.base.SpeculatorSettings` it is served with.
    """

    name = "medusa"
    head: MedusaHead

    @classmethod
    def load(cls, folder: Path, target: TargetInfo) -> MedusaHead:
        """:func:`load_medusa`.

        Raises:
            SpeculatorLoadError: naming the file and the key that does not fit.
        """
        return load_medusa(folder, target)

    @torch.inference_mode()
    def propose(self, requests: list[ProposalRequest]) -> list[Proposal]:
        """One proposal per request, in order: [k'] int64 drafts, k' <= min(k, n heads), ``draft_probs`` None, score
        the sum of the running products of the drafts' probabilities (empty without hidden states).

        Raises:
            ValueError: from a request's grammar (:func:`~spec_decode.proposers.base.draft_token`).
        """
        out = [Proposal.empty() for _ in requests]
        live, states = self.last_states(requests, self.hidden_size)
        if not live or states is None:
            return out
        ks = [min(requests[j].k, self.head.num_heads) for j in live]
        logits = self.head(states, max(ks))  # [n', B, V] float32 on the head's device
        vocab = logits.shape[-1]
        for row, (j, k) in enumerate(zip(live, ks)):
            r = requests[j]
            drafts: list[int] = []
            running, score = 1.0, 0.0
            for i in range(k):
                _, probs = draft_token(logits[i, row], r, NoisePurpose.MEDUSA, i, drafts, None, self.grammar, vocab)
                if not confident(running, probs, self.min_token_prob):
                    break
                tok = int(torch.argmax(probs))
                running *= float(probs[tok])
                drafts.append(tok)
                score += running
            if drafts:
                out[j] = Proposal(torch.tensor(drafts, dtype=torch.int64), None, score)
        return out
