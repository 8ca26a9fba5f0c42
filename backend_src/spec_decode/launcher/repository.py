"""The model repository the launcher serves: its models, copies with config parameters overridden, and what its
configs say (the speculative methods offered, which models are decoupled, which run in Python-backend processes).
"""

from __future__ import annotations

import os
import re
import shutil
import tempfile
from functools import partial
from pathlib import Path

MODELS = ("generate", "generate_trtllm", "spec_step", "score_step", "greedy_step", "draft_model", "target_model",
          "verifier")
REPO_ROOT = Path(__file__).resolve().parents[3]
DEFAULT_REPOSITORY = REPO_ROOT / "model_repository"

_PARAM = r'(parameters:\s*\{{\s*key:\s*"{key}"\s*value:\s*\{{\s*string_value:\s*)"[^"]*"'
_DECOUPLED = re.compile(r"model_transaction_policy\s*\{[^}]*decoupled\s*:\s*true", re.S)
_PYTHON = re.compile(r'^\s*backend\s*:\s*"python"', re.M)


def _quoted_value(value: str, m: re.Match) -> str:
    # re.subn replacement as a function, so that ``value`` is taken literally (no backslash escapes)
    return m.group(1) + f'"{value}"'


def prepare_repository(overrides: dict[str, dict[str, str]] | None = None, src: Path = DEFAULT_REPOSITORY) -> Path:
    """The model repository to serve: ``src`` itself, or a copy with config parameters overridden.

    Args:
        overrides: model name -> {parameter key -> string value}, e.g. ``{"draft_model": {"draft_model_path": p}}``.
        src: the repository to start from.

    Returns:
        ``src`` when there is nothing to override, else a new temporary folder (left for the caller to remove).

    The environment variable ``DTYPE`` (as the launcher's ``--dtype``), when set, is target_model's and draft_model's
    ``dtype`` wherever ``overrides`` set none: so ``DTYPE=float32`` reaches every server the repository's tools start
    (the launcher, the benchmarks, the tests).

    Raises:
        KeyError: an override names a parameter that the model's config.pbtxt does not have.
        ValueError: ``DTYPE`` is not one of :data:`DTYPES`.
    """
    env_dtype = os.environ.get("DTYPE", "").strip()
    if env_dtype:
        if env_dtype not in DTYPES:
            raise ValueError(f"DTYPE {env_dtype!r}: one of {', '.join(DTYPES)}")
        overrides = {m: dict(p) for m, p in (overrides or {}).items()}
        for model in ("target_model", "draft_model"):
            overrides.setdefault(model, {}).setdefault("dtype", env_dtype)
    if not overrides:
        return src
    dst = Path(tempfile.mkdtemp(prefix="spec_decode_repo_"))
    shutil.copytree(src, dst, dirs_exist_ok=True, ignore=shutil.ignore_patterns("__pycache__"))
    for model, params in overrides.items():
        cfg = dst / model / "config.pbtxt"
        text = cfg.read_text()
        for key, value in params.items():
            text, n = re.subn(_PARAM.format(key=re.escape(key)), partial(_quoted_value, value), text)
            if n != 1:
                raise KeyError(f"{model}/config.pbtxt has no parameter {key!r}")
        cfg.write_text(text)
    return dst


def draft_overrides(draft_model_path: str) -> dict[str, dict[str, str]]:
    """Config overrides (for :func:`prepare_repository`) that serve ``draft_model_path`` as the draft LM and enable
    speculative_method=draft."""
    return {
        "draft_model": {"draft_model_path": draft_model_path},
        "generate": {"draft_model_available": "true"},
    }


DTYPES = ("auto", "float32", "bfloat16", "float16")  # --dtype
DEVICES = ("auto", "cpu", "cuda")  # --device


def check_flag_values(dtype: str = "", device: str = "", max_model_len: int = 0, kv_cache_max_tokens: int = 0) -> None:
    """The launcher's ``--dtype``, ``--device``, ``--max-model-len`` and ``--kv-cache-max-tokens`` checked on their
    own (no model read), as the models' settings will check them (0 or "": the config's value).

    Raises:
        ValueError: naming the flag, its value and the allowed values.
    """
    from ..settings import LMSettings

    if dtype and dtype not in DTYPES:
        raise ValueError(f"--dtype / DTYPE {dtype!r}: one of {', '.join(DTYPES)}")
    if device and device not in DEVICES:
        raise ValueError(f"--device {device!r}: one of {', '.join(DEVICES)}")
    if max_model_len and max_model_len < 2:
        raise ValueError(f"--max-model-len {max_model_len}: at least 2 (a prompt token and one generated)")
    if kv_cache_max_tokens and kv_cache_max_tokens < LMSettings.MIN_KV_CACHE_TOKENS:
        raise ValueError(f"--kv-cache-max-tokens {kv_cache_max_tokens}: at least {LMSettings.MIN_KV_CACHE_TOKENS} "
                         f"(target_model's smallest KV pool), or 0 for target_model's config")


def model_overrides(model: str, dtype: str = "", device: str = "", max_model_len: int = 0,
                    kv_cache_max_tokens: int = 0) -> tuple[dict[str, dict[str, str]], Path, str]:
    """Config overrides (for :func:`prepare_repository`) that serve ``model`` as the target: its ``model_path``
    (target_model), the tokenizer of every model that reads one (generate, draft_model), and no draft LM or head made
    for the embedded target (draft_model's ``draft_model_path`` and ``speculator_path`` emptied: ``--draft-model`` and
    ``--speculator`` add their own). The model is checked before anything starts
    (:func:`~spec_decode.engine.model_loading.check_servable`).

    Args:
        model: a folder, a Hugging Face id (``org/name``, resolved offline from the local hub cache:
            :func:`~spec_decode.engine.model_loading.hub_snapshot`), or ``default``.
        dtype: one of :data:`DTYPES` for target_model and draft_model ("": their configs').
        device: one of :data:`DEVICES` for both ("": their configs').
        max_model_len: generate's ``max_model_len`` (0: its config's), at most the model's positions.
        kv_cache_max_tokens: target_model's KV pool positions (0: its config's).

    Returns:
        (overrides, the model's folder, the name OpenAI clients send by default: the id's last part or the folder's
        name).

    Raises:
        FileNotFoundError: no such folder, or an id not in the local cache (naming where it looked and the
            ``hf download`` command).
        ValueError: a model the engine cannot serve, a ``max_model_len`` above its positions (naming both), or a
            value outside the allowed ones (named).
    """
    from ..engine.model_loading import check_servable, is_hub_id, resolve_model_path

    check_flag_values(dtype, device, max_model_len, kv_cache_max_tokens)
    folder = resolve_model_path(model)
    if folder is None:
        raise ValueError(f"--model {model!r} names no model")
    check_servable(folder, max_model_len or None)
    name = model.strip().rstrip("/").split("/")[-1] if is_hub_id(model) else folder.name
    target = {"model_path": str(folder)}
    draft = {"tokenizer_path": str(folder), "draft_model_path": "", "speculator_path": ""}
    generate = {"tokenizer_path": str(folder)}
    for params, key, value in ((target, "dtype", dtype), (draft, "dtype", dtype), (target, "device", device),
                               (draft, "device", device), (target, "kv_cache_max_tokens", kv_cache_max_tokens),
                               (generate, "max_model_len", max_model_len)):
        if value:
            params[key] = str(value)
    return {"target_model": target, "draft_model": draft, "generate": generate}, folder, name


def served_methods(repo: Path) -> str:
    """The ``speculative_method`` values that repository ``repo`` offers its clients, for the launcher's banner.

    Computed as generate computes them, from draft_model's and generate's config parameters (``auto`` last: it
    chooses among the others).

    Returns:
        The methods, comma-separated; ``?`` when the configs cannot be read, ``? (<why>)`` when they are invalid.
    """
    from ..proposers import offered_methods
    from ..protocol import AUTO
    from ..serving.adapter import sibling_parameters

    own = {"model_repository": str(repo / "generate")}
    draft, gen = sibling_parameters(own, "draft_model"), sibling_parameters(own, "generate")
    if draft is None or gen is None:
        return "?"
    forced = gen.get("draft_model_available", "auto")
    try:
        return ", ".join((*offered_methods(draft, None if forced == "auto" else forced == "true"), AUTO))
    except ValueError as e:
        return f"? ({e})"


def served_dtype(repo: Path) -> str:
    """The banner's dtype: target_model's ``dtype`` and ``device`` parameters in repository ``repo`` resolved as the
    model resolves them at load (:func:`~spec_decode.engine.dtype_choice.choose_dtype`), with the reason; ``?`` when
    the config cannot be read, ``? (<why>)`` when its values are invalid."""
    from ..engine.dtype_choice import choose_dtype
    from ..engine.model_loading import resolve_device
    from ..serving.adapter import sibling_parameters

    target = sibling_parameters({"model_repository": str(repo / "generate")}, "target_model")
    if target is None:
        return "?"
    try:
        return str(choose_dtype(target.get("dtype", "auto"), resolve_device(target.get("device", "auto"))))
    except (KeyError, ValueError, RuntimeError) as e:
        return f"? ({e})"


def served_speculators(repo: Path) -> str:
    """The banner's lines on the speculator heads repository ``repo`` serves: ``  <method>  <folder>  (<variant>)``
    each (from draft_model's ``speculator_path``; the variant as
    :func:`~spec_decode.proposers.speculators.layouts.describe_variant` names it), or one line saying why they cannot
    be listed; "" when none."""
    from ..proposers.speculators import SpeculatorLoadError, SpeculatorSettings, served_heads
    from ..proposers.speculators.layouts import describe_variant
    from ..serving.adapter import sibling_parameters

    draft = sibling_parameters({"model_repository": str(repo / "generate")}, "draft_model")
    try:
        heads = served_heads(SpeculatorSettings.from_params(draft or {}).speculator_path)
    except (SpeculatorLoadError, ValueError) as e:
        return f"  speculators: ? ({e})\n"
    return "".join(f"  {method:<18} {path}  ({describe_variant(path, method)})\n" for method, path in heads.items())


def _config(cfg: Path) -> str:
    # config.pbtxt without its comments
    return "\n".join(line.split("#", 1)[0] for line in cfg.read_text().splitlines())


def decoupled_models(repository: Path) -> set[str]:
    """Names of the repository's models whose ``config.pbtxt`` sets ``model_transaction_policy { decoupled: true }``."""
    return {cfg.parent.name for cfg in Path(repository).glob("*/config.pbtxt") if _DECOUPLED.search(_config(cfg))}


def python_models(repository: Path) -> set[str]:
    """Names of the repository's models served by the Python backend (``backend: "python"``): those with processes."""
    return {cfg.parent.name for cfg in Path(repository).glob("*/config.pbtxt") if _PYTHON.search(_config(cfg))}
