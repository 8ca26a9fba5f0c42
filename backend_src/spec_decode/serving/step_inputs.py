"""Decoding the step protocol's inputs: one sequence's row of a step model's request, checked once.

The step models (draft_model, target_model, verifier) get their inputs from generate's rounds, but spec_step and
score_step are reachable by any client too, so every value is checked here, by the rules of
:mod:`spec_decode.settings` and :class:`~spec_decode.sampling.SamplingParams`, and the code behind trusts it. A row's
values are numpy arrays, or torch tensors for GPU inputs (:func:`~.adapter.read_rows`).
"""

from __future__ import annotations

import numpy as np
import torch

from ..proposers import NO_SPECULATION, ProposalRequest
from ..sampling import SamplingParams
from ..settings import InvalidInputError, check_acceptance_method, in_range, one_of
from .adapter import strip_padding

DRAFT_MODEL_INPUTS = ("sequence_id", "token_ids", "num_draft_tokens", "speculative_method", "temperature", "top_k",
                      "top_p", "random_seed", "seeded", "step", "release")
TARGET_MODEL_INPUTS = ("sequence_id", "token_ids", "draft_token_ids", "temperature", "top_k", "top_p", "release")
VERIFIER_INPUTS = ("target_probs", "draft_token_ids", "draft_probs", "temperature", "random_seed", "step",
                   "acceptance_method")

_REQUIRED = object()


def scalar(inputs: dict, name: str, default=_REQUIRED):
    """The one value of input ``name`` ([1] per row), or ``default`` when absent.

    Raises:
        InvalidInputError: a required input that is missing.
    """
    v = inputs.get(name)
    if v is None:
        if default is _REQUIRED:
            raise InvalidInputError(name, "required")
        return default
    return np.asarray(v.cpu() if isinstance(v, torch.Tensor) else v).reshape(-1)[0]


def text(inputs: dict, name: str, default: str = "") -> str:
    """A STRING input's one value, decoded."""
    v = scalar(inputs, name, default)
    return v.decode() if isinstance(v, bytes) else str(v)


def sequence_id(inputs: dict) -> int:
    """The row's sequence id (uint64)."""
    return int(scalar(inputs, "sequence_id"))


def is_release(inputs: dict) -> bool:
    """Whether the row ends its sequence (frees its caches) instead of stepping it."""
    return bool(scalar(inputs, "release", False))


def token_ids(inputs: dict) -> list[int]:
    """The row's committed token ids, without padding.

    Raises:
        InvalidInputError: none left (the range is the model's own check: :meth:`~spec_decode.kv_cache.
            CachedCausalLM.check`).
    """
    ids = strip_padding(inputs["token_ids"]) if "token_ids" in inputs else []
    if not ids:
        raise InvalidInputError("token_ids", "must not be empty")
    return ids


def sampling_params(inputs: dict) -> SamplingParams:
    """The row's sampling parameters (checked by :class:`~spec_decode.sampling.SamplingParams`)."""
    return SamplingParams(
        temperature=float(scalar(inputs, "temperature", 0.0)),
        top_k=int(scalar(inputs, "top_k", 0)),
        top_p=float(scalar(inputs, "top_p", 1.0)),
        seed=int(scalar(inputs, "random_seed", 0)),
        seeded=bool(scalar(inputs, "seeded", True)),
    )


def acceptance_method(inputs: dict) -> str:
    """The row's acceptance method, or "" for the verifier's default."""
    method = text(inputs, "acceptance_method")
    return check_acceptance_method("acceptance_method", method) if method.strip() else ""


def proposal_request(inputs: dict, methods, max_k: int) -> tuple[str, ProposalRequest | None]:
    """draft_model's row as (method, proposal request), or (method, None) when it asks for no drafts (``none`` or
    k = 0).

    Args:
        methods: the methods draft_model serves (``none`` and its proposers' names).
        max_k: the largest k a row may ask for.

    Raises:
        InvalidInputError: a k outside [0, max_k], a method not served here, or no token ids.
    """
    k = in_range("num_draft_tokens", int(scalar(inputs, "num_draft_tokens", 0)), 0, max_k)
    method = one_of("speculative_method", text(inputs, "speculative_method", NO_SPECULATION), tuple(methods),
                    " (served by draft_model here)")
    if method == NO_SPECULATION or k == 0:
        return method, None
    return method, ProposalRequest(sequence_id(inputs), token_ids(inputs), k, sampling_params(inputs),
                                   int(scalar(inputs, "step", 0)))
