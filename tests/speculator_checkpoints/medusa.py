"""Tiny Medusa checkpoints written as their authors publish them, with random weights.

* ``layout="medusa"``: FasterDecoding/Medusa (``medusa/model/medusa_model.py``, ``medusa/train``): ``config.json``
  from ``MedusaConfig.save_pretrained`` (``medusa_num_heads``, ``medusa_num_layers``, ``base_model_name_or_path``)
  and ``medusa_lm_head.safetensors`` (the trainer's ``save_file``) or ``medusa_lm_head.pt`` (``torch.save`` of the
  heads' ``state_dict``), named ``{i}.{j}.linear.weight`` / ``{i}.{j}.linear.bias`` / ``{i}.{L}.weight``. Its heads
  repeat one ``ResBlock`` L times, so the L blocks of a head are written equal, as its ``state_dict`` holds them.
* ``layout="medusa_v2"``: the authors' later training (``medusa/train/train_legacy.py``; TGI's ``MedusaHeadV2``):
  FasterDecoding's config with ``"version": "2"`` and ``medusa_lm_head.pt`` holding the residual blocks only
  (``{i}.{j}.linear.*``), projected by the base model's LM head.
* ``layout="medusa2_full"``: a Medusa-2 full model (``FasterDecoding/medusa-1.0-*``): the base model's config with
  ``medusa_num_heads`` / ``medusa_num_layers``, and the base model's weights and ``medusa_head.{i}...`` sharded in
  ``model-0000k-of-00002.safetensors`` under ``model.safetensors.index.json``.
* ``layout="vllm"``: vLLM's conversion (``vllm/transformers_utils/configs/medusa.py``,
  ``vllm/model_executor/models/medusa.py``): ``config.json`` of ``MedusaConfig`` (``architectures: [MedusaModel]``,
  ``model_type: medusa``, ``num_heads``, ``num_hidden_layers``, ...) and ``model.safetensors`` or
  ``pytorch_model.bin`` named ``blocks.{i}.layers.{j}.weight`` / ``.bias`` and ``lm_heads.{i}.weight`` (none with
  ``original_lm_head``; ``token_map`` with a ``truncated_vocab_size`` below ``vocab_size``).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

BASE_MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"  # what base_model_name_or_path records


def medusa_state(hidden_size: int, vocab_size: int, num_heads: int, num_layers: int, layout: str, seed: int = 0,
                 bias: bool = True, lm_heads: bool = True, token_map: list[int] | None = None) -> dict:
    """Random weights named as ``layout`` names them, float32: blocks ~ N(0, 1/H) (biases ~ N(0, 0.1)), projections
    ~ N(0, 1) so that a head's top token leads the others clearly."""
    g = torch.Generator().manual_seed(seed)
    h, rows = hidden_size, vocab_size if token_map is None else len(token_map)
    state: dict[str, torch.Tensor] = {}
    for i in range(num_heads):
        for j in range(num_layers):
            if layout == "medusa" and j:  # one ResBlock repeated: the same tensors under every index
                w, b = state[f"{i}.0.linear.weight"], state[f"{i}.0.linear.bias"]
            else:
                w, b = torch.randn(h, h, generator=g) / h**0.5, torch.randn(h, generator=g) * 0.1
            if layout == "medusa":
                state[f"{i}.{j}.linear.weight"], state[f"{i}.{j}.linear.bias"] = w.clone(), b.clone()
            else:
                state[f"blocks.{i}.layers.{j}.weight"] = w
                if bias:
                    state[f"blocks.{i}.layers.{j}.bias"] = b
        lm = torch.randn(rows, h, generator=g)
        if layout == "medusa":
            state[f"{i}.{num_layers}.weight"] = lm
        elif lm_heads:
            state[f"lm_heads.{i}.weight"] = lm
    if token_map is not None:
        state["token_map"] = torch.tensor(token_map, dtype=torch.int64)
    return state


def write_medusa(folder: Path | str, hidden_size: int, vocab_size: int, num_heads: int = 4, num_layers: int = 1,
                 layout: str = "medusa", fmt: str = "safetensors", seed: int = 0, drop_weights: tuple[str, ...] = (),
                 config: dict | None = None, **overrides) -> Path:
    """Write a tiny Medusa checkpoint into ``folder`` (created) and return it.

    Args:
        hidden_size, vocab_size: the sizes the weights are made for (a target's, or wrong ones for the error tests).
        num_heads, num_layers: n heads of L residual blocks.
        layout: ``medusa`` (FasterDecoding) or ``vllm`` (vLLM's conversion).
        fmt: ``safetensors`` or ``pt`` (``medusa_lm_head.pt`` / ``pytorch_model.bin``).
        seed: the weights' seed.
        drop_weights: weight names left out of the file.
        config: more config.json entries replaced, for the names the arguments take (``num_heads``,
            ``vocab_size``, ...).
        overrides: config.json entries replaced (None: removed). In the vLLM layout ``medusa_fc_bias``,
            ``original_lm_head`` and ``truncated_vocab_size`` also shape the weights written (no biases; no
            ``lm_heads``; a random ``token_map`` and truncated projections).
    """
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    if layout == "medusa2_full":
        return _write_full_model(folder, hidden_size, vocab_size, num_heads, num_layers, seed)
    if layout in ("medusa", "medusa_v2"):
        cfg: dict = {"base_model_name_or_path": BASE_MODEL, "medusa_num_heads": num_heads,
                     "medusa_num_layers": num_layers, "transformers_version": "4.41.2"}
        state = medusa_state(hidden_size, vocab_size, num_heads, num_layers, "medusa", seed)
        name = "medusa_lm_head.safetensors" if fmt == "safetensors" else "medusa_lm_head.pt"
        if layout == "medusa_v2":  # blocks only, projected by the base model's LM head
            cfg["version"] = "2"
            state = {k: t for k, t in state.items() if ".linear." in k}
    elif layout == "vllm":
        cfg = {"architectures": ["MedusaModel"], "hidden_size": hidden_size, "max_paths": 64, "max_seq_len": 2**20,
               "medusa_fc_bias": True, "model_type": "medusa", "num_heads": num_heads,
               "num_hidden_layers": num_layers, "original_lm_head": False, "topk": 10, "torch_dtype": "float32",
               "transformers_version": "4.41.2", "truncated_vocab_size": vocab_size, "vocab_size": vocab_size}
        cfg.update({k: v for k, v in overrides.items() if k in ("medusa_fc_bias", "original_lm_head",
                                                                "truncated_vocab_size")})
        truncated = cfg["truncated_vocab_size"]
        token_map = None
        if isinstance(truncated, int) and truncated < vocab_size:
            g = torch.Generator().manual_seed(seed + 1)
            token_map = sorted(torch.randperm(vocab_size, generator=g)[:truncated].tolist())
        state = medusa_state(hidden_size, vocab_size, num_heads, num_layers, layout, seed,
                             bias=bool(cfg["medusa_fc_bias"]), lm_heads=not cfg["original_lm_head"],
                             token_map=token_map)
        name = "model.safetensors" if fmt == "safetensors" else "pytorch_model.bin"
    else:
        raise ValueError(f"layout {layout!r}: medusa or vllm")
    for key, value in {**overrides, **(config or {})}.items():
        if value is None:
            cfg.pop(key, None)
        else:
            cfg[key] = value
    state = {k: v for k, v in state.items() if k not in drop_weights}
    (folder / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    if fmt == "safetensors":
        from safetensors.torch import save_file

        save_file(state, str(folder / name), metadata={"format": "pt"})
    elif fmt == "pt":
        torch.save(state, folder / name)
    else:
        raise ValueError(f"fmt {fmt!r}: safetensors or pt")
    return folder


def _write_full_model(folder: Path, hidden_size: int, vocab_size: int, num_heads: int, num_layers: int,
                      seed: int) -> Path:
    """A Medusa-2 full model (module docstring): base weights in the first shard, the heads in the second."""
    from safetensors.torch import save_file

    heads = {f"medusa_head.{k}": t for k, t in medusa_state(hidden_size, vocab_size, num_heads, num_layers, "medusa",
                                                             seed).items()}
    g = torch.Generator().manual_seed(seed + 7)
    base = {"model.embed_tokens.weight": torch.randn(vocab_size, hidden_size, generator=g),
            "model.norm.weight": torch.ones(hidden_size), "lm_head.weight": torch.randn(vocab_size, hidden_size,
                                                                                         generator=g)}
    shards = {"model-00001-of-00002.safetensors": base, "model-00002-of-00002.safetensors": heads}
    for name, part in shards.items():
        save_file(part, str(folder / name), metadata={"format": "pt"})
    index = {"metadata": {"total_size": 0}, "weight_map": {k: name for name, part in shards.items() for k in part}}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    cfg = {"architectures": ["MedusaModelLlama"], "model_type": "llama", "hidden_size": hidden_size,
           "vocab_size": vocab_size, "num_hidden_layers": 2, "medusa_num_heads": num_heads,
           "medusa_num_layers": num_layers, "transformers_version": "4.36.2"}
    (folder / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    return folder
