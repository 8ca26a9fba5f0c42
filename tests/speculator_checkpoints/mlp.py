"""Tiny IBM MLP speculator checkpoints (``MLPSpeculatorPreTrainedModel``), written as fms-extras publishes them.

Config keys: fms-extras ``fms_extras/models/hf/modeling_mlp_speculator.py`` (``MLPSpeculatorConfig``) and vLLM
``vllm/transformers_utils/configs/mlp_speculator.py`` (which adds ``tie_weights``); weights: fms-extras
``MLPSpeculator`` under the ``speculator.`` attribute of ``MLPSpeculatorPreTrainedModel``. Hugging Face's
``save_pretrained`` writes safetensors with each shared tensor once (tied heads keep index 0, and ``proj.1``); a
``torch.save`` of the state dict (fms-native files, ArcticTraining's ``pytorch_model.bin``) keeps every name.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch


def mlp_tensors(gen: torch.Generator, hidden: int, inner: int, vocab: int, n: int, tie: bool
                ) -> dict[str, torch.Tensor]:
    """fms-extras ``MLPSpeculator``'s state dict (every name; tied stages share one tensor), random: embeddings,
    projections and LM heads ~ N(0, 1 / inner) as its ``reset_parameters``, norms' scales near 1 and shifts near 0."""

    def normal(*shape: int, std: float) -> torch.Tensor:
        return torch.randn(*shape, generator=gen) * std

    std = inner**-0.5
    emb = [normal(vocab, inner, std=std) for _ in range(n)]
    proj = [normal(inner, hidden if i == 0 else inner, std=std) for i in range(n)]
    head = [normal(vocab, inner, std=std) for _ in range(n)]
    ln_w = [1 + normal(inner, std=0.2) for _ in range(n)]
    ln_b = [normal(inner, std=0.2) for _ in range(n)]
    out: dict[str, torch.Tensor] = {}
    for i in range(n):
        t = 0 if tie else i  # fms-extras ties embeddings, heads and norms to stage 0, projections 2.. to 1
        out[f"emb.{i}.weight"] = emb[t]
        out[f"proj.{i}.weight"] = proj[min(i, 1) if tie else i]
        out[f"head.{i}.weight"] = head[t]
        out[f"ln.{i}.weight"], out[f"ln.{i}.bias"] = ln_w[t], ln_b[t]
    return out


def save_tensors(folder: Path, tensors: dict[str, torch.Tensor], weights_format: str) -> Path:
    """Write ``model.safetensors`` (each shared tensor once, under its first name, as ``save_pretrained`` does) or
    ``pytorch_model.bin`` (``torch.save`` of every name); returns the file."""
    if weights_format == "safetensors":
        from safetensors.torch import save_file

        seen: set[int] = set()
        unique = {}
        for name, t in tensors.items():
            if id(t) not in seen:
                seen.add(id(t))
                unique[name] = t.contiguous()
        save_file(unique, str(folder / "model.safetensors"), metadata={"format": "pt"})
        return folder / "model.safetensors"
    assert weights_format == "bin", weights_format
    torch.save(tensors, folder / "pytorch_model.bin")
    return folder / "pytorch_model.bin"


def write_mlp_speculator(folder: Path, hidden_size: int, vocab_size: int, n_predict: int = 3, inner_dim: int = 0,
                         tie_weights: bool = False, scale_input: bool = False, prefix: bool = True,
                         old_config: bool = False, seed: int = 0, weights_format: str = "safetensors",
                         **overrides) -> Path:
    """A random MLP speculator folder: ``config.json`` and ``model.safetensors`` (or ``pytorch_model.bin``).

    Args:
        folder: created if missing.
        hidden_size, vocab_size: ``emb_dim`` and ``vocab_size`` (the target's).
        n_predict: heads. inner_dim: the heads' width (0: emb_dim, as published).
        tie_weights, scale_input: the config flags (vLLM's ``MLPSpeculatorConfig``).
        prefix: weight names under ``speculator.`` (``save_pretrained``), else bare (fms-native, ArcticTraining).
        old_config: leave ``tie_weights`` and ``scale_input`` out of the config (the first published configs).
        seed: of the random weights.
        weights_format: ``safetensors`` or ``bin``.
        overrides: config keys to set after the defaults (the weights follow the resulting emb_dim, inner_dim,
            vocab_size and n_predict).

    Returns:
        ``folder``.
    """
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    cfg = {"architectures": ["MLPSpeculatorPreTrainedModel"], "emb_dim": hidden_size, "inner_dim": inner_dim,
           "model_type": "mlp_speculator", "n_candidates": 5, "n_predict": n_predict, "scale_input": scale_input,
           "tie_weights": tie_weights, "top_k_tokens_per_head": [max(1, 5 - i) for i in range(n_predict)],
           "torch_dtype": "float32", "transformers_version": "4.44.2", "vocab_size": vocab_size}
    if old_config:
        del cfg["scale_input"], cfg["tie_weights"]
    cfg.update(overrides)
    (folder / "config.json").write_text(json.dumps(cfg, indent=2))
    n, hidden, vocab = int(cfg["n_predict"]), int(cfg["emb_dim"]), int(cfg["vocab_size"])
    tensors = mlp_tensors(torch.Generator().manual_seed(seed), hidden, int(cfg["inner_dim"]) or hidden, vocab, n,
                          bool(cfg.get("tie_weights")))
    save_tensors(folder, {("speculator." if prefix else "") + k: v for k, v in tensors.items()}, weights_format)
    return folder
