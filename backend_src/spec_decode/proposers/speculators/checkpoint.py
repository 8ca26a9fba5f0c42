"""Reading a published speculator's folder: its ``config.json`` and weights, with load errors that name the file and
the key that does not fit.

Published heads come as Hugging Face folders: ``config.json`` plus one weights file, safetensors or a PyTorch pickle
(``pytorch_model.bin``, Medusa's ``medusa_lm_head.pt``). Pickles are read with ``torch.load(weights_only=True)``, which
refuses anything but tensors and plain containers.
"""

from __future__ import annotations

import json
import zipfile
from pathlib import Path
from typing import Any

import torch

CONFIG_FILE = "config.json"
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")


class SpeculatorLoadError(ValueError):
    """A speculator folder that cannot be served.

    Attributes:
        file: the file at fault (``config.json``, a weights file, or the folder itself).
        key: the config key or weight name that does not fit (``architectures``, ``hidden_size``,
            ``fc.weight``, ...).
        detail: what is wrong and what was expected.
    """

    def __init__(self, file: Path | str, key: str, detail: str):
        self.file, self.key, self.detail = str(file), key, detail
        super().__init__(f"speculator checkpoint {self.file}: {key!r}: {detail}")


def read_config(folder: Path) -> dict[str, Any]:
    """The folder's ``config.json`` as a dict.

    Raises:
        SpeculatorLoadError: no such file, or not a JSON object.
    """
    path = Path(folder) / CONFIG_FILE
    if not path.is_file():
        raise SpeculatorLoadError(folder, CONFIG_FILE, "missing: a speculator folder holds config.json and its weights")
    try:
        cfg = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise SpeculatorLoadError(path, CONFIG_FILE, f"not JSON ({e})") from None
    if not isinstance(cfg, dict):
        raise SpeculatorLoadError(path, CONFIG_FILE, "must hold a JSON object")
    return cfg


def find_weights(folder: Path, preferred: tuple[str, ...] = ("model.safetensors", "pytorch_model.bin")) -> Path:
    """The folder's weights file: the first of ``preferred`` that exists, else the only ``*.safetensors`` /
    ``*.bin`` / ``*.pt`` file there.

    Raises:
        SpeculatorLoadError: none, or several candidates and none preferred.
    """
    folder = Path(folder)
    for name in preferred:
        if (folder / name).is_file():
            return folder / name
    found = sorted(p for p in folder.iterdir() if p.is_file() and p.suffix in WEIGHT_SUFFIXES)
    if len(found) != 1:
        what = "none" if not found else ", ".join(p.name for p in found)
        raise SpeculatorLoadError(folder, "weights", f"expected one weights file ({', '.join(preferred)}), "
                                                     f"found {what}")
    return found[0]


def load_weights(file: Path, prefix: str = "") -> dict[str, torch.Tensor]:
    """Every tensor of a weights file (safetensors, or a PyTorch pickle of tensors) on the CPU, as stored; with
    ``prefix``, only those whose names start with it, read without loading the rest (a safetensors file's tensors one
    by one, a pickle memory-mapped): a few weights out of a large shard.

    Raises:
        SpeculatorLoadError: a file that does not read as either.
    """
    file = Path(file)
    if file.suffix != ".safetensors":
        state = _load_pickle(file, mmap=bool(prefix))
        return {k: t for k, t in state.items() if k.startswith(prefix)} if prefix else state
    try:
        if prefix:
            from safetensors import safe_open

            with safe_open(str(file), framework="pt") as f:
                return {k: f.get_tensor(k) for k in f.keys() if k.startswith(prefix)}
        from safetensors.torch import load_file

        return load_file(str(file))
    except Exception as e:  # noqa: BLE001 - any reader error is a load error naming the file
        raise SpeculatorLoadError(file, "weights", f"unreadable ({type(e).__name__}: {e})") from None


def _load_pickle(file: Path, mmap: bool) -> dict[str, torch.Tensor]:
    """A PyTorch pickle's tensors (``torch.load(weights_only=True)``; memory-mapped when ``mmap``: only the pickle's
    structure is read, a tensor's data when it is used), unwrapped from a ``state_dict`` entry.

    Raises:
        SpeculatorLoadError: a file that does not read (with ``mmap``, also a legacy-format pickle, which cannot be
            mapped), or that holds other than names and tensors.
    """
    try:
        state = torch.load(file, map_location="cpu", weights_only=True, mmap=mmap)
    except Exception as e:  # noqa: BLE001 - any reader error is a load error naming the file
        raise SpeculatorLoadError(file, "weights", f"unreadable ({type(e).__name__}: {e})") from None
    if isinstance(state, dict) and "state_dict" in state and isinstance(state["state_dict"], dict):
        state = state["state_dict"]
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise SpeculatorLoadError(file, "weights", "must hold a mapping of names to tensors")
    return state


def weight_shapes(file: Path) -> dict[str, tuple[int, ...]] | None:
    """Name -> shape of every tensor of a weights file, without reading their data: a safetensors file's header
    (``safe_open(...).get_slice(name).get_shape()``), a pickle memory-mapped (its structure only); None for a pickle
    that is not in the zip format ``torch.save`` writes (the legacy format, ``_use_new_zipfile_serialization=False``,
    cannot be mapped; nor can a file that is no pickle, which :func:`load_weights` then refuses).

    Raises:
        SpeculatorLoadError: a file that does not read (naming it).
    """
    file = Path(file)
    if file.suffix != ".safetensors":
        if not zipfile.is_zipfile(file):  # torch.save's format is a zip archive; the legacy one cannot be mapped
            return None
        return {k: tuple(t.shape) for k, t in _load_pickle(file, mmap=True).items()}
    try:
        from safetensors import safe_open

        with safe_open(str(file), framework="pt") as f:
            return {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
    except Exception as e:  # noqa: BLE001 - any reader error is a load error naming the file
        raise SpeculatorLoadError(file, "weights", f"unreadable ({type(e).__name__}: {e})") from None


def weight_names(file: Path) -> list[str]:
    """The tensor names of a weights file, reading as little as the format allows (a safetensors header; a pickle is
    memory-mapped, or read whole in the legacy format).

    Raises:
        SpeculatorLoadError: as :func:`load_weights`.
    """
    shapes = weight_shapes(file)
    return list(shapes) if shapes is not None else list(load_weights(file))


def take(state: dict[str, torch.Tensor], key: str, shape: tuple[int, ...], file: Path | str,
         why: str = "") -> torch.Tensor:
    """``state[key]`` as float32, checked to have ``shape`` (-1: any size there).

    Args:
        state: the loaded weights.
        key: the weight name.
        shape: the expected shape.
        file: the weights file (for the error).
        why: what the sizes come from, for the error (e.g. "hidden size 576 of the target").

    Raises:
        SpeculatorLoadError: the weight is missing or has another shape (naming the file and the key).
    """
    if key not in state:
        near = sorted(state)[:8]
        raise SpeculatorLoadError(file, key, f"missing weight (the file holds {len(state)}: {', '.join(near)}"
                                             f"{', ...' if len(state) > len(near) else ''})")
    t = state[key]
    check_shape(tuple(t.shape), key, shape, file, why)
    return t.float()


def check_shape(found: tuple[int, ...], key: str, shape: tuple[int, ...], file: Path | str, why: str = "") -> None:
    """Check that weight ``key`` of shape ``found`` (loaded, or read from a file's header: :func:`weight_shapes`) has
    ``shape`` (-1: any size there), as :func:`take` does.

    Raises:
        SpeculatorLoadError: another shape (naming the file, the key and ``why``).
    """
    if len(found) != len(shape) or any(s != -1 and s != d for s, d in zip(shape, found)):
        want = "x".join("*" if s == -1 else str(s) for s in shape)
        raise SpeculatorLoadError(file, key, f"shape {list(found)}, expected [{want}]" + (f" ({why})" if why else ""))


def config_int(cfg: dict[str, Any], key: str, file: Path | str, default: int | None = None, low: int = 1) -> int:
    """An integer config value >= ``low``; ``default`` when absent (None: required).

    Raises:
        SpeculatorLoadError: missing without a default, not an integer, or below ``low``.
    """
    if key not in cfg or cfg[key] is None:
        if default is None:
            raise SpeculatorLoadError(file, key, "missing from config.json")
        return default
    value = cfg[key]
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise SpeculatorLoadError(file, key, f"must be an integer >= {low}, got {value!r}")
    return value


def decoder_layer_sizes(cfg: dict[str, Any], file: Path | str, hidden: int) -> tuple[int, int, int, int]:
    """A Llama decoder layer's sizes from its config: (``num_attention_heads``, ``num_key_value_heads`` (default: the
    attention heads), ``head_dim`` (default: ``hidden`` / heads), ``intermediate_size``).

    Raises:
        SpeculatorLoadError: a size missing (heads, intermediate size) or not an integer >= 1 (:func:`config_int`).
    """
    heads = config_int(cfg, "num_attention_heads", file)
    kv = config_int(cfg, "num_key_value_heads", file, default=heads)
    head_dim = config_int(cfg, "head_dim", file, default=hidden // heads)
    return heads, kv, head_dim, config_int(cfg, "intermediate_size", file)


def expect(cfg: dict[str, Any], key: str, value: int, file: Path | str, what: str) -> None:
    """Check that config ``key``, when present, equals ``value`` (the target's).

    Raises:
        SpeculatorLoadError: it differs: ``what`` names the target's size (e.g. "the target's hidden size").
    """
    if key in cfg and cfg[key] is not None and cfg[key] != value:
        raise SpeculatorLoadError(file, key, f"{cfg[key]!r} does not fit {what} ({value})")
