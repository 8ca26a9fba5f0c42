"""What a Medusa folder says, read without the weights' data: its config (:func:`check_medusa_config`), the layout of
FasterDecoding's weights from their names and shapes, and whether it fits the target (:func:`check_medusa_fit`: what
the launcher checks before it starts, :func:`~spec_decode.proposers.speculators.check_heads_fit`). The loaders of
:mod:`.published` read the same config and check the same shapes on the loaded weights."""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from ..checkpoint import (
    CONFIG_FILE,
    SpeculatorLoadError,
    check_shape,
    config_int,
    expect,
    find_weights,
    read_config,
    weight_shapes,
)
from ..target import TargetInfo

logger = logging.getLogger(__name__)
T = TypeVar("T")

FASTER_DECODING_FILES = ("medusa_lm_head.safetensors", "medusa_lm_head.pt")  # FasterDecoding's weights file names


def strip_prefix(state: dict[str, T], prefix: str) -> dict[str, T]:
    """The weights with ``prefix`` dropped from the names that start with it."""
    return {k[len(prefix):] if k.startswith(prefix) else k: v for k, v in state.items()}


def _layout(cfg: dict[str, Any]) -> str | None:
    """``vllm`` (vLLM's ``MedusaModel`` conversion), ``medusa`` (FasterDecoding's ``medusa_num_heads``), or None."""
    archs = cfg.get("architectures") or []
    archs = [str(a) for a in archs] if isinstance(archs, list) else [str(archs)]
    if "MedusaModel" in archs or cfg.get("model_type") == "medusa":
        return "vllm"
    return "medusa" if "medusa_num_heads" in cfg else None


def sharded_index(folder: Path) -> tuple[Path, list[str]] | None:
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
        num_heads: n as the config says (FasterDecoding's files may hold more: :func:`~.published.load_medusa`).
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
    """A Medusa folder's ``config.json`` read and checked before its weights, as
    :func:`~.published.load_medusa` does first: its layout (FasterDecoding's ``medusa_num_heads``, or vLLM's
    ``MedusaModel``), the heads' and blocks' counts, and in vLLM's layout ``truncated_vocab_size`` <= ``vocab_size``
    and a finite ``logit_scale`` (FasterDecoding/Medusa ``MedusaConfig``; vLLM
    ``transformers_utils/configs/medusa.py``).

    The config's sizes are compared with the target's after the weights (whose errors name the weight), by
    :func:`~.published.load_medusa` and by :func:`check_medusa_fit`.

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
    sharded = None if any((folder / f).is_file() for f in FASTER_DECODING_FILES) else sharded_index(folder)
    files = [folder / shard for shard in sharded[1]] if sharded is not None else \
        [find_weights(folder, FASTER_DECODING_FILES)]
    shapes: dict[str, tuple[int, ...]] = {}
    for file in files:
        found = weight_shapes(file)
        if found is None:
            return None
        shapes.update({k: t for k, t in found.items() if sharded is None or k.startswith("medusa_head.")})
    return (sharded[0] if sharded is not None else files[0]), strip_prefix(shapes, "medusa_head.")


def faster_decoding_heads(c: MedusaConfig, names: Mapping[str, Any], warn: bool = True) -> tuple[int, bool]:
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


def faster_decoding_shapes(n: int, layers: int, v2: bool, target: TargetInfo
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


def check_config_sizes(c: MedusaConfig, target: TargetInfo) -> None:
    """The config's ``hidden_size`` and ``vocab_size``, when it has them (vLLM's conversion, a Medusa-2 full model's
    base config), against the target's: the loaders compare them after the weights, whose errors name the weight.

    Raises:
        SpeculatorLoadError: naming ``config.json`` and the key.
    """
    expect(c.cfg, "hidden_size", target.hidden_size, c.file, "the target's hidden size")
    expect(c.cfg, "vocab_size", target.vocab_size, c.file, "the target's vocabulary size")


def check_medusa_fit(folder: Path | str, target: TargetInfo) -> MedusaConfig:
    """A Medusa folder checked against the target without reading its weights' data: :func:`check_medusa_config`,
    then the sizes :func:`~.published.load_medusa` checks once it has the weights, from the weights' shapes
    (FasterDecoding's layout, whose config has no sizes: the blocks [H, H] and projections [V, H] of the weights
    file's header, or of a memory-mapped pickle; skipped for a legacy-format pickle) and the config's ``hidden_size`` /
    ``vocab_size`` (vLLM's conversion, a Medusa-2 full model's base config). What the launcher checks before it starts
    anything (:func:`~spec_decode.proposers.speculators.check_heads_fit`).

    A weight the file lacks is left to the loader (naming it); the target's own LM head (version 2, vLLM's
    ``original_lm_head``) is not read.

    Raises:
        SpeculatorLoadError: as :func:`~.published.load_medusa`, naming the file and the key that does not fit.
    """
    folder = Path(folder)
    c = check_medusa_config(folder, target)
    found = _faster_decoding_weight_shapes(folder) if c.layout == "medusa" else None
    if found is not None:
        file, shapes = found
        n, v2 = faster_decoding_heads(c, shapes, warn=False)
        for key, (shape, why) in faster_decoding_shapes(n, c.num_layers, v2, target).items():
            if key in shapes:
                check_shape(shapes[key], key, shape, file, why)
    check_config_sizes(c, target)
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
