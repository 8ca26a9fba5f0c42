"""The step protocol on the wire: one row of a step model's inputs decoded and checked once (a round's inputs are
encoded by :mod:`.round_codec`).

The step models (draft_model, target_model, verifier) get their inputs from generate's rounds, but spec_step and
score_step are reachable by any client too, so every value is checked here, by the rules of
:mod:`spec_decode.settings` and :class:`~spec_decode.sampling.SamplingParams`, and the code behind trusts it. A row's
values are numpy arrays, or torch tensors for GPU inputs (:func:`~.adapter.read_rows`).
"""

from __future__ import annotations

import numpy as np
import torch

from ..processors import ProcessorSpec, parse_spec
from ..proposers import NO_SPECULATION, ProposalRequest, registry
from ..sampling import SamplingParams
from ..settings import InvalidInputError, check_acceptance_method, in_range, one_of
from ..tree import MAX_TREE_DEPTH, MAX_TREE_TOP_K, check_tree, is_chain
from .adapter import strip_padding
from .wire import scalar, text

MAX_TOKEN_ID = 2**31 - 1  # token ids travel as int64 but every tree and model here takes int32 ids


def needs_hidden_states(method: str) -> bool:
    """Whether ``method``'s proposer drafts from the target's hidden states."""
    cls = registry.PROPOSERS.get(method)
    return cls is not None and cls.needs_hidden_states


def context_hidden_states(inputs: dict) -> torch.Tensor | None:
    """The row's context hidden states ([m, H] float32, without padding), or None when it has none.

    Raises:
        InvalidInputError: a count outside [0, rows sent].
    """
    n = int(scalar(inputs, "num_context_hidden_states", 0))
    hidden = inputs.get("context_hidden_states")
    rows = 0 if hidden is None or len(hidden.shape) != 2 else int(hidden.shape[0])
    in_range("num_context_hidden_states", n, 0, rows)
    if n == 0:
        return None
    return torch.as_tensor(np.asarray(hidden.cpu() if isinstance(hidden, torch.Tensor) else hidden)[:n],
                           dtype=torch.float32)


def sequence_id(inputs: dict) -> int:
    """The row's sequence id (uint64)."""
    return int(scalar(inputs, "sequence_id"))


def is_release(inputs: dict) -> bool:
    """Whether the row ends its sequence (frees its caches) instead of stepping it."""
    return bool(scalar(inputs, "release", False))


def token_ids(inputs: dict) -> list[int]:
    """The row's committed token ids, without padding.

    Raises:
        InvalidInputError: none left, or one outside [0, 2^31) (the model's vocabulary is its own check:
            :meth:`~spec_decode.engine.kv_cache.CachedCausalLM.check`; model-free proposers and suffix decoding's
            int32 trees take any id in that range).
    """
    ids = strip_padding(inputs["token_ids"]) if "token_ids" in inputs else []
    if not ids:
        raise InvalidInputError("token_ids", "must not be empty")
    if min(ids) < 0 or max(ids) > MAX_TOKEN_ID:
        raise InvalidInputError("token_ids", f"token ids must lie in [0, 2^31), got {min(ids)}..{max(ids)}")
    return ids


def draft_token_ids(inputs: dict, vocab_size: int) -> list[int]:
    """The row's draft token ids, without padding, up to the first one outside the target's vocabulary [0,
    ``vocab_size``): a draft is only a guess, and one the target cannot score ends the drafts instead of failing the
    step (target_model and the verifier cut at the same place). Proposers never make such drafts; suffix decoding's
    cache could hold one that a direct caller of draft_model released."""
    drafts = strip_padding(inputs.get("draft_token_ids", np.zeros(0, np.int64)))
    for i, t in enumerate(drafts):
        if not 0 <= t < vocab_size:
            return drafts[:i]
    return drafts


def draft_parents(inputs: dict, drafts: list[int]) -> list[int] | None:
    """The parents of the row's ``drafts`` (:func:`draft_token_ids`) from ``draft_parents`` (INT32 [k], padded in a
    batch: its first ``len(drafts)`` entries), or None for a chain (absent, empty or ``[-1, 0, 1, ...]``).

    Raises:
        InvalidInputError: (``draft_parents``) fewer parents than drafts, or not a tree of them
            (:func:`~spec_decode.tree.check_tree`).
    """
    raw = inputs.get("draft_parents")
    if raw is None or not drafts:
        return None
    values = np.asarray(raw.cpu() if isinstance(raw, torch.Tensor) else raw).reshape(-1)
    if values.size == 0:
        return None
    if values.dtype.kind not in "iu":
        raise InvalidInputError("draft_parents", f"expected integers, got dtype {values.dtype}")
    if values.size < len(drafts):
        raise InvalidInputError("draft_parents", f"expected one parent per draft ({len(drafts)}), got {values.size}")
    parents = check_tree(drafts, values[: len(drafts)].tolist())
    return None if is_chain(parents) else parents


def sampling_params(inputs: dict) -> SamplingParams:
    """The row's sampling parameters (checked by :class:`~spec_decode.sampling.SamplingParams`)."""
    return SamplingParams(
        temperature=float(scalar(inputs, "temperature", 0.0)),
        top_k=int(scalar(inputs, "top_k", 0)),
        top_p=float(scalar(inputs, "top_p", 1.0)),
        seed=int(scalar(inputs, "random_seed", 0)),
        seeded=bool(scalar(inputs, "seeded", True)),
    )


def processor_spec(inputs: dict) -> ProcessorSpec | None:
    """The row's logits processors and log-prob requests (``logits_processors``, JSON), or None when it has none.

    Raises:
        InvalidInputError: text that is not a valid spec (naming the field at fault).
    """
    return parse_spec(text(inputs, "logits_processors", ""))


def scheduled_tokens(inputs: dict) -> int:
    """The row's ``num_scheduled_tokens``: its share of the round's token budget (0, or absent: no bound).

    Raises:
        InvalidInputError: a value outside [0, 2^31).
    """
    return in_range("num_scheduled_tokens", int(scalar(inputs, "num_scheduled_tokens", 0)), 0, MAX_TOKEN_ID)


def acceptance_method(inputs: dict) -> str:
    """The row's acceptance method, or "" for the verifier's default."""
    method = text(inputs, "acceptance_method", "")
    return check_acceptance_method("acceptance_method", method) if method.strip() else ""


def proposal_request(inputs: dict, methods, max_k: int) -> tuple[str, ProposalRequest | None]:
    """draft_model's row as (method, proposal request), or (method, None) when it asks for no drafts (``none`` or
    k = 0). The optional ``draft_tree`` (absent: False) becomes :attr:`ProposalRequest.tree`, and the optional
    ``tree_top_k`` and ``tree_depth`` (absent: 0, the proposer's config) its tree's shape.

    Args:
        methods: the methods draft_model serves (``none`` and its proposers' names).
        max_k: the largest k a row may ask for.

    Raises:
        InvalidInputError: a k outside [0, max_k], a method not served here, no token ids, or a ``tree_top_k`` or
            ``tree_depth`` outside [0, MAX_TREE_TOP_K] or [0, MAX_TREE_DEPTH] (:mod:`spec_decode.tree`).
    """
    k = in_range("num_draft_tokens", int(scalar(inputs, "num_draft_tokens", 0)), 0, max_k)
    method = one_of("speculative_method", text(inputs, "speculative_method", NO_SPECULATION), tuple(methods),
                    " (served by draft_model here)")
    if method == NO_SPECULATION or k == 0:
        return method, None
    hidden = context_hidden_states(inputs) if needs_hidden_states(method) else None
    return method, ProposalRequest(sequence_id(inputs), token_ids(inputs), k, sampling_params(inputs),
                                   int(scalar(inputs, "step", 0)), hidden, processor_spec(inputs),
                                   bool(scalar(inputs, "draft_tree", False)),
                                   in_range("tree_top_k", int(scalar(inputs, "tree_top_k", 0)), 0, MAX_TREE_TOP_K),
                                   in_range("tree_depth", int(scalar(inputs, "tree_depth", 0)), 0, MAX_TREE_DEPTH))
