"""Which published layout a speculator folder holds, and which heads ``speculator_path`` serves.

Each layout is recognised from the folder alone, as its authors publish it (the loaders check the rest):

============== ============================================================ =========================================
method         recognised by                                                public source of the layout
============== ============================================================ =========================================
``eagle``      ``EAGLEModel`` / ``model_type: eagle`` (vLLM's conversion),  SafeAILab/EAGLE (EAGLE-1/2, ``yuhuili/
               or a one-layer ``LlamaForCausalLM`` whose weights hold       EAGLE-*``); vLLM ``model_executor/models/
               ``fc.weight``                                                eagle.py``
``eagle3``     ``LlamaForCausalLMEagle3``, or ``draft_vocab_size`` in the   SafeAILab/EAGLE ``eagle/traineagle3``;
               config (the EAGLE-3 trainer's ``LlamaForCausalLM``)          vLLM ``models/llama_eagle3.py``
``medusa``     ``medusa_num_heads`` (FasterDecoding), or ``MedusaModel`` /  FasterDecoding/Medusa; vLLM
               ``model_type: medusa`` (vLLM's conversion)                   ``models/medusa.py``
``mlp_         ``MLPSpeculatorPreTrainedModel`` / ``model_type:             foundation-model-stack/fms-extras;
speculator``   mlp_speculator``                                             vLLM ``models/mlp_speculator.py``
``arctic``     ``ArcticMLPSpeculatorPreTrainedModel`` or                    snowflakedb/ArcticInference
               ``ArcticLSTMSpeculatorPreTrainedModel``
============== ============================================================ =========================================
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from .checkpoint import CONFIG_FILE, SpeculatorLoadError, find_weights, read_config, weight_names

HEAD_METHODS = ("eagle", "eagle3", "medusa", "mlp_speculator", "arctic")  # the methods a speculator folder serves
AUTO = "auto"  # in speculator_path: the head `make speculator` trains, when it has been built


def _archs(cfg: dict[str, Any]) -> list[str]:
    a = cfg.get("architectures") or []
    return [str(x) for x in a] if isinstance(a, list) else [str(a)]


def detect(folder: Path) -> str:
    """The method a speculator folder serves (one of :data:`HEAD_METHODS`), from its config and weight names.

    Raises:
        SpeculatorLoadError: no config.json, or a layout none of the loaders knows (naming ``architectures``).
    """
    folder = Path(folder)
    cfg = read_config(folder)
    archs, model_type = _archs(cfg), str(cfg.get("model_type") or "")
    if any(a.startswith(("ArcticMLPSpeculator", "ArcticLSTMSpeculator")) or a == "MLPVariantSpeculatorPreTrainedModel"
           for a in archs):
        return "arctic"
    if "MLPSpeculatorPreTrainedModel" in archs or model_type == "mlp_speculator":
        return "mlp_speculator"
    if "medusa_num_heads" in cfg or "MedusaModel" in archs or model_type == "medusa":
        return "medusa"
    if any("eagle3" in a.lower() for a in archs) or "draft_vocab_size" in cfg:
        return "eagle3"
    if "EAGLEModel" in archs or model_type == "eagle":
        return "eagle"
    if cfg.get("num_hidden_layers") == 1 and any(a.endswith("ForCausalLM") for a in archs):
        names = weight_names(find_weights(folder))
        if any(n in ("fc.weight", "model.fc.weight") for n in names):
            return "eagle"
    raise SpeculatorLoadError(Path(folder) / CONFIG_FILE, "architectures",
                              f"{archs or model_type or 'none'} is not a speculator layout served here (known: EAGLE "
                              f"and EAGLE-3 heads, Medusa, MLPSpeculatorPreTrainedModel, "
                              f"ArcticMLPSpeculatorPreTrainedModel, ArcticLSTMSpeculatorPreTrainedModel)")


def describe_variant(folder: Path, method: str) -> str:
    """The published variant a head folder of ``method`` holds, in a few words for the launcher's banner (e.g.
    "EAGLE-1, the EAGLE authors' layout, q/k/v biases"), read from its config and weight names only (the loaders
    check the rest). Never raises: an unreadable folder gives "?".

    The variants are those docs/speculators.md lists, after each family's published sources (SafeAILab/EAGLE, vLLM,
    SGLang, the ``speculators`` library, FasterDecoding/Medusa, fms-extras, ArcticTraining)."""
    try:
        return _variant(Path(folder), method)
    except (SpeculatorLoadError, OSError, ValueError, TypeError, KeyError):  # a folder the loader refuses, naming why
        return "?"


def _variant(folder: Path, method: str) -> str:
    """:func:`describe_variant` without its guard."""
    cfg = read_config(folder)
    names = set(weight_names(find_weights(folder))) if method == "eagle" else set()
    parts: list[str] = []
    archs = _archs(cfg)
    if method == "eagle":
        from ..eagle.published import eagle1_options

        options = eagle1_options(cfg, names)  # what load_eagle1 builds
        inner = options["cfg"]
        if "EAGLEModel" in archs:
            parts.append("EAGLE-1, vLLM's conversion")
        elif options["vllm"]:
            parts.append("EAGLE-1, vLLM's conversion script")
        else:
            parts.append("EAGLE-1, the EAGLE authors' layout")
        if options["qkv_bias"]:
            parts.append("q/k/v biases")
        if options["para_norm"]:
            parts.append("HASS norms")
        truncated = cfg.get("truncated_vocab_size")
        if isinstance(truncated, int) and truncated < int(inner.get("vocab_size") or truncated):
            parts.append(f"a truncated vocabulary of {truncated}")
    elif method == "eagle3":
        speculators = isinstance(cfg.get("transformer_layer_config"), dict)
        parts.append("EAGLE-3, the speculators library's layout" if speculators else
                     "EAGLE-3, the EAGLE authors' layout" if any("eagle3" in a.lower() for a in archs) else
                     "EAGLE-3, the EAGLE-3 trainer's layout")
        parts += [flag for flag in ("norm_before_residual", "norm_before_fc") if cfg.get(flag)]
        if cfg.get("target_hidden_size"):
            parts.append(f"target_hidden_size {cfg['target_hidden_size']}")
        ids = _explicit_layer_ids(cfg)
        if isinstance(ids, list) and ids:
            parts.append(f"{'output-of-layer ids, read +1' if _output_of_layer(cfg, ids) else 'layer ids'} {ids}")
    elif method == "medusa":
        if "MedusaModel" in archs or cfg.get("model_type") == "medusa":
            parts.append("Medusa, vLLM's conversion")
        elif (folder / "model.safetensors.index.json").is_file() or (folder / "pytorch_model.bin.index.json").is_file():
            parts.append("Medusa-2, the heads of a full model")
        else:
            parts.append("Medusa, FasterDecoding's layout" + (", version 2 (the target's LM head)"
                                                               if str(cfg.get("version", "")) == "2" else ""))
    elif method == "mlp_speculator":
        parts.append("MLP speculator (fms-extras)")
        parts += [flag for flag in ("tie_weights", "scale_input") if cfg.get(flag)]
    elif method == "arctic":
        lstm = any(a.startswith("ArcticLSTMSpeculator") for a in archs)
        parts.append(f"Arctic LSTM speculator, {cfg.get('method', 'sum_rnn')}" if lstm else "Arctic MLP speculator")
    return ", ".join(parts) or method


def trained_head_dir() -> Path | None:
    """The head ``make speculator`` trained for the embedded target, when it is built in the EAGLE-3 layout (else
    None)."""
    from ..eagle.artifacts import REPORT_FILE, default_eagle_dir

    d = default_eagle_dir()
    if not (d / REPORT_FILE).exists():
        return None
    try:  # a head an earlier version trained, in its own layout: not served (make speculator --fresh retrains)
        return d if detect(d) == "eagle3" else None
    except SpeculatorLoadError:
        return None


def split_paths(value: str) -> list[str]:
    """``speculator_path``'s entries: separated by commas (and by ``:`` as in ``SPECULATORS=a:b``), blanks
    dropped; ``none`` alone means no entry."""
    items = [x.strip() for x in (value or "").replace(":", ",").split(",")]
    items = [x for x in items if x]
    return [] if [x.lower() for x in items] == ["none"] else items


def served_heads(value: str) -> dict[str, Path]:
    """method -> folder of every head ``speculator_path`` serves, in the order given.

    ``auto`` stands for the head ``make speculator`` trains (when built; skipped otherwise); a folder given after it
    whose method is the same replaces it. Two folders of the same method are refused.

    Raises:
        SpeculatorLoadError: a folder that does not exist or whose layout is unknown, or two folders of one method.
    """
    out: dict[str, Path] = {}
    trained: set[str] = set()
    for item in split_paths(value):
        if item.lower() == AUTO:
            path = trained_head_dir()
            if path is None:
                continue
            from_auto = True
        else:
            path, from_auto = Path(item).expanduser(), False
            if not path.is_dir():
                raise SpeculatorLoadError(path, "speculator_path", "no such folder")
        method = detect(path)
        if method in out and method not in trained:
            raise SpeculatorLoadError(path, "speculator_path",
                                      f"a second {method} head (the first is {out[method]}); give one per method")
        out[method] = path
        trained.discard(method)
        if from_auto:
            trained.add(method)
    return out


def _explicit_layer_ids(cfg: dict[str, Any]) -> Any:
    """An EAGLE-3 config's ``eagle_config.eagle_aux_hidden_state_layer_ids`` (or the same key at its top), as written;
    None when absent."""
    nested: dict[str, Any] = cfg["eagle_config"] if isinstance(cfg.get("eagle_config"), dict) else {}
    return nested.get("eagle_aux_hidden_state_layer_ids", cfg.get("eagle_aux_hidden_state_layer_ids"))


def _output_of_layer(cfg: dict[str, Any], ids: list) -> bool:
    """Whether explicit layer ids are in the output-of-layer convention (SGLang PR #25454: the first id is 1), for a
    head not trained here (``spec_decode.trained_by``: those name layer inputs)."""
    return bool(ids) and ids[0] == 1 and "trained_by" not in (cfg.get("spec_decode") or {})


def eagle3_layer_ids(cfg: dict[str, Any], num_layers: int, file: Path | str = CONFIG_FILE) -> list[int]:
    """The target layers whose inputs an EAGLE-3 head reads, in its ``fc``'s order: ``eagle_config.
    eagle_aux_hidden_state_layer_ids`` (or the same key at the top of its config) when given, else layers 2, L // 2
    and L - 3 as the EAGLE authors and vLLM use (``aux_hidden_state_layers``).

    Ids are in the input-of-layer convention (vLLM's: id i is the residual stream entering layer i; L is the last
    layer's output, before the final norm). Explicit ids come in two conventions (SGLang PR #25454): trainers that
    name the output of layer X (SpecForge) start at 1, the output of the first layer, which is never the embedding;
    those are read as X + 1, as SGLang reads them. A head trained here (``spec_decode.trained_by`` in its config)
    names input-of-layer ids whatever its first id.

    Raises:
        SpeculatorLoadError: ids that are not integers in [0, L] (a target too shallow for the default ones).
    """
    ids = _explicit_layer_ids(cfg)
    if ids is None:
        ids = [2, num_layers // 2, num_layers - 3]
    elif isinstance(ids, list) and _output_of_layer(cfg, ids):
        ids = [i + 1 if isinstance(i, int) else i for i in ids]
    if not isinstance(ids, list) or not ids or not all(isinstance(i, int) and 0 <= i <= num_layers for i in ids):
        raise SpeculatorLoadError(file, "eagle_aux_hidden_state_layer_ids",
                                  f"must be layer ids in [0, {num_layers}] (the target has {num_layers} layers; "
                                  f"{num_layers}: the last layer's output), got {ids!r}")
    return list(ids)


def aux_hidden_state_layers(speculator_path: str, num_layers: int) -> list[int]:
    """The target layers whose inputs the target must return beside its last hidden state for the heads
    ``speculator_path`` serves: the sorted union of the EAGLE-3 heads' :func:`eagle3_layer_ids` ([] when none).

    The target's ``hidden_states`` output is then [k+1, H x (1 + len(layers))]: the last (normed) hidden state, then
    each of these layers' inputs in this order; a head finds its layers' columns by their index here.

    Raises:
        SpeculatorLoadError: as :func:`served_heads`.
    """
    heads = served_heads(speculator_path)
    if "eagle3" not in heads:
        return []
    return sorted(set(eagle3_layer_ids(read_config(heads["eagle3"]), num_layers, heads["eagle3"] / CONFIG_FILE)))
