"""Every published layout, written for the embedded target (SmolLM2-135M-Instruct: hidden 576, 9 heads of 64, 3
key/value heads, MLP 1536, vocabulary 49152, 30 layers), with random weights, for the tests that serve them through a
real tritonserver."""

from __future__ import annotations

import json
from pathlib import Path

from .arctic import write_arctic
from .eagle import write_eagle1, write_eagle3
from .medusa import write_medusa
from .mlp import write_mlp_speculator


def target_sizes(model_dir: Path) -> dict:
    """hidden, vocab, heads, kv_heads, inter, layers of the target in ``model_dir`` (its config.json)."""
    c = json.loads((Path(model_dir) / "config.json").read_text())
    return {"hidden": c["hidden_size"], "vocab": c["vocab_size"], "heads": c["num_attention_heads"],
            "kv_heads": c["num_key_value_heads"], "inter": c["intermediate_size"], "layers": c["num_hidden_layers"]}


def embedding(model_dir: Path):
    """The target's input embedding [V, H] float32, from its safetensors."""
    from safetensors import safe_open

    with safe_open(str(Path(model_dir) / "model.safetensors"), framework="pt") as f:
        return f.get_tensor("model.embed_tokens.weight").float()


def write_published_heads(folder: Path, model_dir: Path) -> dict[str, Path]:
    """One head per method for the target in ``model_dir``, each in its authors' layout: ``eagle`` (yuhuili's
    EAGLE-1, pytorch_model.bin with the embedding), ``eagle3`` (``LlamaForCausalLMEagle3``, default layers, the
    target's embedding shared), ``medusa`` (FasterDecoding, 3 heads), ``mlp_speculator`` (IBM, 3 positions), ``arctic``
    (Arctic's MLP speculator), ``arctic_lstm`` (Arctic's LSTM speculator; a second ``arctic`` head, served alone), and
    published variants served in place of the first ones: ``eagle_qwen2_hass``, ``eagle3_speculators``,
    ``medusa_v2``.

    Returns:
        name -> folder.
    """
    s, folder = target_sizes(model_dir), Path(folder)
    h, v = s["hidden"], s["vocab"]
    return {
        "eagle": write_eagle1(folder / "eagle", embedding(model_dir), s["heads"], s["kv_heads"], s["inter"]),
        "eagle3": write_eagle3(folder / "eagle3", h, v, s["heads"], s["kv_heads"], s["inter"], 4096),
        "medusa": write_medusa(folder / "medusa", h, v, num_heads=3),
        "mlp_speculator": write_mlp_speculator(folder / "mlp", h, v, n_predict=3, inner_dim=256),
        "arctic": write_arctic(folder / "arctic", h, v, kind="mlp", inner_dim=256),
        "arctic_lstm": write_arctic(folder / "arctic_lstm", h, v, kind="lstm", inner_dim=256),
        # published variants: EAGLE-1 with q/k/v biases and HASS norms as vLLM's conversion script writes it,
        # EAGLE-3 in the speculators library's layout with norm_before_fc and norm_before_residual, Medusa version 2
        "eagle_qwen2_hass": write_eagle1(folder / "eagle_qwen2_hass", embedding(model_dir), s["heads"], s["kv_heads"],
                                         s["inter"], layout="vllm_script", qkv_bias="qkv_bias", para_norm=True),
        "eagle3_speculators": write_eagle3(folder / "eagle3_speculators", h, v, s["heads"], s["kv_heads"], s["inter"],
                                           4096, layout="speculators", embedding=embedding(model_dir),
                                           norm_before_fc=True, norm_before_residual=True),
        "medusa_v2": write_medusa(folder / "medusa_v2", h, v, num_heads=3, layout="medusa_v2", fmt="pt"),
    }


def main(argv: list[str] | None = None) -> int:
    """``python -m tests.speculator_checkpoints.embedded FOLDER``: write every layout for the embedded target under
    FOLDER and print the ``SPECULATORS`` value that serves one head of each method (random weights: their drafts are
    rarely accepted, the output stays the target's)."""
    import argparse

    from spec_decode.engine.model_loading import resolve_model_path

    ap = argparse.ArgumentParser(description=main.__doc__)
    ap.add_argument("folder", type=Path)
    args = ap.parse_args(argv)
    model_dir = resolve_model_path("default")
    assert model_dir is not None, "the embedded model is not prepared: run make setup"
    heads = write_published_heads(args.folder, model_dir)
    for name, path in heads.items():
        print(f"{name:15s} {path}")
    print("SPECULATORS=" + ":".join(str(heads[m]) for m in ("eagle", "eagle3", "medusa", "mlp_speculator", "arctic")))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
