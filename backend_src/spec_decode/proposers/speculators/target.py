"""What a speculator must fit: the target's sizes, and the weights a head shares with it (the input embedding, the
LM head), read from the target's folder without loading the target."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from .checkpoint import SpeculatorLoadError


@dataclass
class TargetInfo:
    """The target's sizes (from its ``config.json``) and, on demand, its shared weights.

    Attributes:
        path: the target's folder (None: built from a loaded model, :meth:`from_model`).
        hidden_size: H.
        vocab_size: V (rows of its LM head).
        num_layers: L, decoder layers (EAGLE-3's auxiliary layers are counted in them).
        architectures: the ``architectures`` of its config (Arctic's ``base_model_archs`` check).
        max_position_embeddings: its position bound (0: unknown).
        tie_word_embeddings: whether its LM head is its input embedding.
    """

    path: Path | None
    hidden_size: int
    vocab_size: int
    num_layers: int
    architectures: tuple[str, ...] = ()
    max_position_embeddings: int = 0
    tie_word_embeddings: bool = False
    _tensors: dict[str, torch.Tensor] = field(default_factory=dict, repr=False)

    @classmethod
    def from_folder(cls, path: Path) -> TargetInfo:
        """Sizes from the folder's ``config.json`` (a Llama-style transformers config, or one nesting it under
        ``text_config``).

        Raises:
            SpeculatorLoadError: no readable config, not a JSON object, or sizes missing from it or not integers.
        """
        file = Path(path) / "config.json"
        try:
            cfg = json.loads(file.read_text())
        except (OSError, ValueError) as e:
            raise SpeculatorLoadError(file, "config.json", f"the target's config does not read ({e})") from None
        text = cfg.get("text_config") or cfg if isinstance(cfg, dict) else None
        if not isinstance(text, dict):
            raise SpeculatorLoadError(file, "config.json", "the target's config is not a JSON object")
        try:
            return cls(Path(path), int(text["hidden_size"]), int(text["vocab_size"]), int(text["num_hidden_layers"]),
                       tuple(cfg.get("architectures") or ()), int(text.get("max_position_embeddings") or 0),
                       bool(cfg.get("tie_word_embeddings", text.get("tie_word_embeddings", False))))
        except KeyError as e:
            raise SpeculatorLoadError(file, str(e.args[0]), "missing from the target's config") from None
        except (TypeError, ValueError) as e:  # null, a string, a list where a size belongs
            raise SpeculatorLoadError(file, "config.json", f"the target's sizes are not integers ({e})") from None

    @classmethod
    def from_model(cls, model: torch.nn.Module) -> TargetInfo:
        """From a loaded transformers ``*ForCausalLM`` (tests, in-process use); its embedding and LM head are taken
        from the model itself."""
        c: Any = model.config
        archs = tuple(getattr(c, "architectures", None) or (type(model).__name__,))
        info = cls(None, int(c.hidden_size), int(c.vocab_size), int(c.num_hidden_layers), archs,
                   int(getattr(c, "max_position_embeddings", 0) or 0), bool(getattr(c, "tie_word_embeddings", False)))
        info._tensors["embed"] = model.get_input_embeddings().weight.detach().float()  # type: ignore[operator]
        info._tensors["head"] = model.get_output_embeddings().weight.detach().float()  # type: ignore[operator]
        return info

    def _read(self, suffixes: tuple[str, ...]) -> torch.Tensor | None:
        """The first tensor of the target's safetensors files whose name ends with one of ``suffixes``."""
        from safetensors import safe_open

        assert self.path is not None
        for file in sorted(self.path.glob("*.safetensors")):
            with safe_open(str(file), framework="pt") as f:
                for suffix in suffixes:
                    for name in f.keys():
                        if name == suffix or name.endswith("." + suffix):
                            return f.get_tensor(name).float()
        return None

    def embeddings(self) -> torch.Tensor:
        """The target's input embedding [V, H] float32 (read once).

        Raises:
            SpeculatorLoadError: the target's folder holds no ``embed_tokens.weight`` in safetensors.
        """
        if "embed" not in self._tensors:
            t = None if self.path is None else self._read(("embed_tokens.weight",))
            if t is None:
                raise SpeculatorLoadError(self.path or "target", "embed_tokens.weight",
                                          "the head shares the target's input embedding, which is not in its "
                                          "safetensors files")
            self._tensors["embed"] = t
        return self._tensors["embed"]

    def lm_head(self) -> torch.Tensor:
        """The target's LM head [V, H] float32 (its input embedding when they are tied).

        Raises:
            SpeculatorLoadError: neither ``lm_head.weight`` nor a tied embedding in its safetensors files.
        """
        if "head" not in self._tensors:
            t = None if self.path is None else self._read(("lm_head.weight",))
            if t is None and not self.tie_word_embeddings:
                raise SpeculatorLoadError(self.path or "target", "lm_head.weight",
                                          "the head shares the target's LM head, which is not in its safetensors "
                                          "files")
            self._tensors["head"] = t if t is not None else self.embeddings()
        return self._tensors["head"]
