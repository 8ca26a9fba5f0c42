"""Whether the heads ``speculator_path`` serves were made for the served target, checked before anything starts
(:func:`check_heads_fit`): each head's config, and where its sizes are only in its weights their shapes from the
file's header, against the target's ``config.json``, with the checks its loader begins with; no weight data is read.

A published head is made for one target: EAGLE's ``fc`` and embedding, EAGLE-3's ``fc`` over three of its layers,
Medusa's and the MLP speculators' blocks and projections all have the target's hidden size and vocabulary (the
loaders: :func:`~spec_decode.proposers.eagle.published.check_eagle1_config`,
:func:`~spec_decode.proposers.eagle.eagle3_published.check_eagle3_config`, :func:`~.medusa.check_medusa_fit`,
:func:`~.mlp.check_mlp_config`, :func:`~.arctic.check_arctic_config`). A head for another target would otherwise
only fail when draft_model loads it, after the servers have started.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from .checkpoint import SpeculatorLoadError, read_config
from .layouts import served_heads
from .target import TargetInfo

# method -> (config sections, None for the top; keys of the target's hidden size; of its vocabulary), where a head's
# config records the target it was made for (first found first), as its loader reads them: for messages only, the
# loader's check deciding whether it fits
_DECLARED: dict[str, tuple[tuple[str | None, ...], tuple[str, ...], tuple[str, ...]]] = {
    "eagle": (("model", None), ("hidden_size",), ("vocab_size",)),  # vLLM's layouts nest the Llama config in "model"
    "eagle3": ((None, "transformer_layer_config"), ("target_hidden_size", "hidden_size"), ("vocab_size",)),
    "medusa": ((None,), ("hidden_size",), ("vocab_size",)),  # FasterDecoding's: in the weights' shapes
    "mlp_speculator": ((None,), ("emb_dim",), ("vocab_size",)),
    "arctic": ((None,), ("input_hidden_dim", "emb_dim"), ("vocab_size",)),
}


class HeadFitError(SpeculatorLoadError):
    """A head that does not fit the served target (most often one made for another target), said in one sentence
    naming the head's folder and method, the target it was made for (sizes, and the name its config records) and the
    served target's folder and sizes, then the loader's own error.

    Attributes:
        file, key, detail: the loader's check that failed (:class:`~.checkpoint.SpeculatorLoadError`).
        head: the head's folder. method: its method.
        target: the served target's folder. made_for: the sizes the head was made for (:func:`declared_target`).
    """

    def __init__(self, head: Path, method: str, target: TargetInfo, cause: SpeculatorLoadError):
        super().__init__(cause.file, cause.key, cause.detail)
        self.head, self.method, self.target = Path(head), method, target.path
        self.made_for = declared_target(head, method)
        hidden, vocab, name = (self.made_for.get(k) for k in ("hidden_size", "vocab_size", "name"))
        served = f"hidden size {target.hidden_size}, vocabulary {target.vocab_size}"
        where = Path(cause.file)
        why = f"{where.name if where.parent == self.head else where} {cause.key!r}: {cause.detail}"
        if (hidden is not None and hidden != target.hidden_size) or (vocab is not None and vocab != target.vocab_size):
            sizes = " and ".join(s for s in (hidden and f"hidden size {hidden}", vocab and f"vocabulary {vocab}") if s)
            message = (f"speculator head {self.head} ({method}) was made for a target of {sizes}"
                       f"{f' ({name})' if name else ''}, not for the served target {self.target} ({served}): serve it "
                       f"with the target it was made for, or give a head made for this target ({why})")
        else:
            message = (f"speculator head {self.head} ({method}) does not fit the served target {self.target} "
                       f"({served}, {target.num_layers} layers): {why}")
        self.args = (message,)


def declared_target(folder: Path, method: str) -> dict[str, Any]:
    """What a head of ``method`` in ``folder`` says of the target it was made for, for messages: ``hidden_size`` and
    ``vocab_size`` (its config's, in the keys its loader reads, else, for FasterDecoding's Medusa heads, its weights'
    shapes from their header: :func:`~.medusa.medusa_weight_sizes`; None where it does not say) and ``name`` (the
    config's ``base_model_name_or_path``, as FasterDecoding and ArcticTraining write it, or the ``speculators``
    library's ``speculators_config.verifier.name_or_path``; None without). Never raises: an unreadable folder says
    nothing."""
    out: dict[str, Any] = {"hidden_size": None, "vocab_size": None, "name": None}
    try:
        cfg = read_config(Path(folder))
    except (SpeculatorLoadError, OSError):
        return out
    sections, hidden_keys, vocab_keys = _DECLARED.get(method, ((None,), ("hidden_size",), ("vocab_size",)))
    dicts = [d for d in (cfg if s is None else cfg.get(s) for s in sections) if isinstance(d, dict)]

    def first(keys: tuple[str, ...]) -> int | None:
        for key in keys:
            for d in dicts:
                value = d.get(key)
                if isinstance(value, int) and not isinstance(value, bool):
                    return value
        return None

    out["hidden_size"], out["vocab_size"] = first(hidden_keys), first(vocab_keys)
    if method == "medusa" and None in (out["hidden_size"], out["vocab_size"]):
        from .medusa import medusa_weight_sizes

        hidden, vocab = medusa_weight_sizes(folder)
        out["hidden_size"] = out["hidden_size"] if out["hidden_size"] is not None else hidden
        out["vocab_size"] = out["vocab_size"] if out["vocab_size"] is not None else vocab
    verifier = (cfg.get("speculators_config") or {}).get("verifier") if isinstance(cfg.get("speculators_config"),
                                                                                  dict) else None
    name = cfg.get("base_model_name_or_path") or (verifier.get("name_or_path") if isinstance(verifier, dict) else None)
    out["name"] = str(name) if name else None
    return out


def _checks() -> dict[str, Callable[[Path, TargetInfo], object]]:
    """method -> the check its loader begins with (imported here: the loaders import this package)."""
    from ..eagle.eagle3_published import check_eagle3_config
    from ..eagle.published import check_eagle1_config
    from .arctic import check_arctic_config
    from .medusa import check_medusa_fit
    from .mlp import check_mlp_config

    return {"eagle": check_eagle1_config, "eagle3": check_eagle3_config, "medusa": check_medusa_fit,
            "mlp_speculator": check_mlp_config, "arctic": check_arctic_config}


def check_heads_fit(speculator_path: str, target_folder: Path | str) -> None:
    """Check that every head ``speculator_path`` serves (:func:`~.layouts.served_heads`: a folder per method, the
    method detected from its layout) fits the target in ``target_folder``, without reading any weight data: what the
    launcher checks before it starts anything, so that a head made for another target is refused there rather than
    when draft_model loads it.

    Each head goes through the check its loader begins with, against :meth:`TargetInfo.from_folder
    <.target.TargetInfo.from_folder>` (the target's ``config.json`` only): EAGLE-1/2's Llama config
    (:func:`~spec_decode.proposers.eagle.published.check_eagle1_config`: ``hidden_size``, ``vocab_size``; SafeAILab/
    EAGLE, vLLM ``eagle.py``), EAGLE-3's (:func:`~spec_decode.proposers.eagle.eagle3_published.check_eagle3_config`:
    ``target_hidden_size`` or ``hidden_size``, ``vocab_size``, the auxiliary layer ids among the target's layers;
    vLLM ``llama_eagle3.py``, the ``speculators`` library), Medusa's (:func:`~.medusa.check_medusa_fit`: the
    config's sizes, or FasterDecoding's blocks and projections from the weights file's header; FasterDecoding/Medusa,
    vLLM ``medusa.py``), the MLP speculator's (:func:`~.mlp.check_mlp_config`: ``emb_dim``, ``vocab_size``;
    fms-extras, vLLM ``mlp_speculator.py``) and Arctic's (:func:`~.arctic.check_arctic_config`: also
    ``base_model_archs``; Arctic Inference). The weights' own shapes beyond these are left to the loaders.

    Args:
        speculator_path: draft_model's ``speculator_path`` (folders separated by commas or ``:``; ``auto``; ``none``).
        target_folder: the served target's folder (its ``config.json``).

    Raises:
        HeadFitError: the first head (in the order given) that does not fit, in one sentence naming its folder, its
            method, the target it was made for (hidden size, vocabulary, the name its config records) and the served
            target's folder and sizes (a :class:`~.checkpoint.SpeculatorLoadError` whose ``file``, ``key`` and
            ``detail`` are the loader's error).
        SpeculatorLoadError: the target's config does not read; a folder that does not exist or whose layout is
            unknown, or two folders of one method (:func:`~.layouts.served_heads`).
    """
    target = TargetInfo.from_folder(Path(target_folder))
    heads = served_heads(speculator_path)
    checks = _checks() if heads else {}
    for method, folder in heads.items():
        try:
            checks[method](folder, target)
        except SpeculatorLoadError as e:
            raise HeadFitError(folder, method, target, e) from e
