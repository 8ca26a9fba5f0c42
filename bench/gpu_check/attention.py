"""Which ``scaled_dot_product_attention`` kernels a served round's attention calls can run on, and so which runs.

PyTorch picks the first kernel (flash, memory-efficient, cuDNN, math: ``torch.nn.attention.SDPBackend``) whose
constraints the call meets: flash takes no ``attn_mask``, the efficient kernel takes a float or boolean mask but
narrower shapes and dtypes, math takes anything and is the slowest. A round's attention calls (the target's and the
draft LM's decoder layers through transformers, the EAGLE heads' own) are recorded as they run
(:func:`record_sdpa`), then each recorded call is run again under each kernel alone (``sdpa_kernel``): the kernels
that accept it and the one PyTorch picks (the first of those, in :data:`PRIORITY`) are reported per call site and
round kind. Rounds run eagerly for this (a graph replay calls no Python), on the shapes the captured graphs use.

On a CPU only flash (PyTorch's CPU flash kernel) and math exist; the report is the same code.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.nn.functional as F

PRIORITY = ("FLASH_ATTENTION", "EFFICIENT_ATTENTION", "CUDNN_ATTENTION", "MATH")
"""The kernels in the order tried (PyTorch's default order for these, cuDNN aside)."""


def _site() -> str:
    from .sync_sentinel import project_frame

    frame = project_frame(Path(__file__).resolve())
    # none: transformers' own attention (the decoder layers of the target and the draft LM)
    return "transformers sdpa_attention_forward" if frame is None else f"{frame[0]}:{frame[2]}"


def _describe(args: tuple, kwargs: dict) -> dict:
    q, k = args[0], args[1]
    mask = kwargs.get("attn_mask", args[3] if len(args) > 3 else None)
    return {"query": list(q.shape), "key": list(k.shape), "dtype": str(q.dtype).removeprefix("torch."),
            "mask": None if mask is None else ("bool" if mask.dtype == torch.bool else f"float ({mask.dtype})"),
            "is_causal": bool(kwargs.get("is_causal", False)), "enable_gqa": bool(kwargs.get("enable_gqa", False))}


@contextlib.contextmanager
def record_sdpa() -> Iterator[list[dict]]:
    """While active, every ``torch.nn.functional.scaled_dot_product_attention`` call is recorded: yields the list
    of distinct calls (the first per site, query length, dtype, mask kind, ``is_causal`` and ``enable_gqa``; batch
    and key length aside), each {"site", "call" (:func:`_describe`), "args", "kwargs"} (kept to be run again)."""
    calls: list[dict] = []
    seen: set[str] = set()
    original = F.scaled_dot_product_attention

    def recording(*args, **kwargs):
        site, desc = _site(), _describe(args, kwargs)
        key = f"{site} {desc['query'][2]} {[desc[f] for f in ('dtype', 'mask', 'is_causal', 'enable_gqa')]}"
        if key not in seen:
            seen.add(key)
            calls.append({"site": site, "call": desc, "args": args, "kwargs": kwargs})
        return original(*args, **kwargs)

    F.scaled_dot_product_attention = recording
    try:
        yield calls
    finally:
        F.scaled_dot_product_attention = original


def kernels_that_run(call: dict) -> list[str]:
    """The kernels of :data:`PRIORITY` that accept ``call`` (one :func:`record_sdpa` record), each tried alone."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    ok = []
    for name in PRIORITY:
        backend = getattr(SDPBackend, name, None)
        if backend is None:
            continue
        try:
            with torch.inference_mode(), sdpa_kernel(backend):
                F.scaled_dot_product_attention(*call["args"], **call["kwargs"])
            ok.append(name)
        except RuntimeError:  # "No available kernel": this kernel does not take the call
            continue
    return ok


@contextlib.contextmanager
def eager_rounds(*lms) -> Iterator[None]:
    """While active, the given :class:`spec_decode.engine.kv_cache.CachedCausalLM` run every round eagerly (their
    graphs set aside), so their attention calls reach Python."""
    saved = [lm.graphs for lm in lms]
    for lm in lms:
        lm.graphs = None
    try:
        yield
    finally:
        for lm, g in zip(lms, saved):
            lm.graphs = g


def attention_report(ensembles: dict, prompts: list[list[int]]) -> list[dict]:
    """The attention calls of the rounds of each kind of :data:`.sync_sentinel.ROUND_KINDS` (a batch of ``prompts``:
    the prefill, then warm rounds), with the kernels that take each and the one PyTorch picks.

    Returns:
        per distinct call: kind (the round's), site, call (shapes, dtype, mask, is_causal, enable_gqa), kernels
        (those that run it), picked (the first of them; None if none ran).
    """
    from .sync_sentinel import ROUND_KINDS, round_syncs

    main = next(iter(ensembles.values()))
    lms = [main.target.lm] + [p.lm for p in main.draft.proposers.values() if hasattr(p, "lm")]
    out = []
    for kind in ROUND_KINDS:
        with eager_rounds(*lms), record_sdpa() as calls:
            round_syncs(ensembles, prompts, cuda=False, kinds=(kind,), measure=False)
        for c in calls:
            kernels = kernels_that_run(c)
            out.append({"kind": kind, "site": c["site"], "call": c["call"], "kernels": kernels,
                        "picked": kernels[0] if kernels else None})
    return out


__all__ = ["PRIORITY", "attention_report", "eager_rounds", "kernels_that_run", "record_sdpa"]
