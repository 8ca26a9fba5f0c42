"""A local Hugging Face hub cache in its real layout, written by the tests (nothing is downloaded).

``huggingface_hub`` stores a model ``org/name`` under ``<cache>/models--org--name/``: ``blobs/<sha256>`` (each file's
content), ``snapshots/<commit>/<file>`` (symlinks into ``blobs``) and ``refs/main`` (the commit ``main`` points at).
"""

from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path


def write_hub_model(cache: Path, repo_id: str, source: Path, commit: str | None = None) -> Path:
    """Put the files of folder ``source`` into ``cache`` as ``repo_id`` at ``commit`` (default: a hash of the files).

    Returns:
        The snapshot folder (``<cache>/models--org--name/snapshots/<commit>``).
    """
    root = Path(cache) / f"models--{repo_id.replace('/', '--')}"
    files = sorted(p for p in Path(source).iterdir() if p.is_file())
    digest = hashlib.sha1()
    for f in files:
        digest.update(f.name.encode() + f.read_bytes())
    commit = commit or digest.hexdigest()
    snapshot = root / "snapshots" / commit
    (root / "blobs").mkdir(parents=True, exist_ok=True)
    snapshot.mkdir(parents=True, exist_ok=True)
    for f in files:
        blob = root / "blobs" / hashlib.sha256(f.read_bytes()).hexdigest()
        if not blob.exists():
            shutil.copyfile(f, blob)
        link = snapshot / f.name
        if not link.exists():
            os.symlink(os.path.relpath(blob, snapshot), link)
    (root / "refs").mkdir(exist_ok=True)
    (root / "refs" / "main").write_text(commit)
    return snapshot


def write_tiny_target(folder: Path, tokenizer_dir: Path, seed: int = 0, **config) -> Path:
    """A tiny random Llama (hidden 32, 2 layers) over the tokenizer in ``tokenizer_dir`` (its files copied beside the
    weights), saved as transformers saves it; ``config`` overrides LlamaConfig keys (e.g. ``sliding_window``)."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tok = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                      bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, tie_word_embeddings=False,
                      **config)
    model = LlamaForCausalLM(cfg)
    folder = Path(folder)
    model.save_pretrained(str(folder))
    tok.save_pretrained(str(folder))
    return folder
