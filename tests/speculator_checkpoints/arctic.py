"""Tiny Arctic speculator checkpoints (``ArcticMLPSpeculatorPreTrainedModel``, ``ArcticLSTMSpeculatorPreTrainedModel``),
written as ArcticTraining saves them and Arctic Inference reads them.

Config keys: ArcticTraining ``projects/arctic_lstm_speculator/speculator/configs.py`` (``ArcticLSTMSpeculatorConfig``:
widths as strings, ``model_type: mlp_speculator``) and ``projects/mlp_speculator/mlp_speculator/configs.py``, plus the
``base_model_archs`` Arctic Inference checks (``arctic_inference/vllm/spec_dec/arctic_proposer.py``). Weights:
ArcticTraining's ``torch.save(speculator.state_dict())`` to ``pytorch_model.bin`` (bare names, every tied name), from
``projects/arctic_lstm_speculator/speculator/speculator.py`` (``ArcticLSTMSpeculator``) and
``projects/mlp_speculator/mlp_speculator/speculator.py``.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from .mlp import mlp_tensors, save_tensors

GATES = ("forget", "input", "output", "cell")


def lstm_tensors(gen: torch.Generator, hidden: int, inner: int, vocab: int, n: int, method: str, tie: bool,
                 tie_lstm_embs: bool) -> dict[str, torch.Tensor]:
    """ArcticTraining ``ArcticLSTMSpeculator``'s state dict for single-width stages (every name; tied modules share a
    tensor), random as its ``reset_parameters`` (N(0, 1 / min(shape))), norms' scales near 1 and shifts near 0."""

    def normal(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen) * min(shape) ** -0.5

    def norm(name: str) -> None:
        out[f"{name}.weight"] = 1 + torch.randn(inner, generator=gen) * 0.2
        out[f"{name}.bias"] = torch.randn(inner, generator=gen) * 0.2

    out: dict[str, torch.Tensor] = {}
    if method == "sum_rnn":  # each stage an nn.Sequential holding one layer: emb.{i}.0.weight
        for i in range(1 if tie else n):
            out[f"emb.{i}.0.weight"] = normal(vocab, inner)
            norm(f"ln.{i}.0")
        for i in range(min(2, n) if tie else n):
            out[f"proj.{i}.0.weight"] = normal(inner, hidden if i == 0 else inner)
    else:
        forget = normal(vocab, inner)
        for g in GATES:
            out[f"{g}_emb.0.weight"] = forget if tie_lstm_embs or g == "forget" else normal(vocab, inner)
        for g in GATES:
            for i in range(2):
                out[f"{g}_proj.{i}.weight"] = normal(inner, hidden if i == 0 else inner)
        norm("cell_ln.0")
        norm("state_ln.0")
    heads = [normal(vocab, inner) for _ in range(n)]
    for i in range(n):
        out[f"head.{i}.weight"] = heads[0] if tie else heads[i]
    return out


def write_arctic(folder: Path, hidden_size: int, vocab_size: int, kind: str = "mlp",
                 base_model_archs: list[str] | None = None, seed: int = 0, n_predict: int = 3,
                 inner_dim: int | None = None, weights_format: str = "bin", **overrides) -> Path:
    """A random Arctic speculator folder: ``config.json`` and ``pytorch_model.bin`` (or ``model.safetensors``).

    Args:
        folder: created if missing.
        hidden_size, vocab_size: the target's (``emb_dim`` / ``input_hidden_dim``, ``vocab_size``).
        kind: ``mlp`` (``ArcticMLPSpeculatorPreTrainedModel``, IBM's keys and names) or ``lstm``
            (``ArcticLSTMSpeculatorPreTrainedModel``; by default ``method: sum_lstm`` with ``tie_weights``,
            ``scale_input`` and ``tie_lstm_embs``, as ArcticTraining's published recipes).
        base_model_archs: the targets it was trained for (default ``["LlamaForCausalLM"]``).
        seed: of the random weights. n_predict: heads. inner_dim: the heads' width (default: hidden_size).
        weights_format: ``bin`` (as ArcticTraining saves) or ``safetensors``.
        overrides: config keys to set after the defaults (``method``, ``tie_weights``, ``tie_lstm_embs``, sizes...);
            the weights follow the resulting config.

    Returns:
        ``folder``.
    """
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    inner = hidden_size if inner_dim is None else inner_dim
    common = {"base_model_archs": list(base_model_archs or ["LlamaForCausalLM"]),
              "base_model_name_or_path": "tiny-random-llama", "model_type": "mlp_speculator",
              "n_candidates": n_predict, "n_predict": n_predict, "top_k_tokens_per_head": [1] * n_predict,
              "torch_dtype": "bfloat16", "transformers_version": "4.51.3", "vocab_size": vocab_size}
    if kind == "mlp":
        cfg = {"architectures": ["ArcticMLPSpeculatorPreTrainedModel"], "emb_dim": hidden_size, "inner_dim": inner,
               "scale_input": True, "tie_weights": True, **common}
    else:
        assert kind == "lstm", kind
        cfg = {"architectures": ["ArcticLSTMSpeculatorPreTrainedModel"], "input_hidden_dim": hidden_size,
               "inner_dim": str(inner), "proj_dim": str(inner), "emb_dim": str(inner), "method": "sum_lstm",
               "scale_input": True, "tie_weights": True, "tie_lstm_embs": True, **common}
    cfg.update(overrides)
    (folder / "config.json").write_text(json.dumps(cfg, indent=2))
    gen, n, vocab = torch.Generator().manual_seed(seed), int(cfg["n_predict"]), int(cfg["vocab_size"])
    if kind == "mlp":
        hidden = int(cfg["emb_dim"])
        tensors = mlp_tensors(gen, hidden, int(cfg["inner_dim"]) or hidden, vocab, n, bool(cfg["tie_weights"]))
    else:
        tensors = lstm_tensors(gen, int(cfg["input_hidden_dim"]), int(str(cfg["inner_dim"]).split(".")[0]), vocab, n,
                               str(cfg.get("method") or "sum_rnn"), bool(cfg["tie_weights"]),
                               bool(cfg.get("tie_lstm_embs")))
    save_tensors(folder, tensors, weights_format)
    return folder
