"""The step protocol on the wire: a round's inputs as generate sends them, and one row decoded and checked once.

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
from ..protocol import StepInputs
from ..sampling import SamplingParams
from ..settings import InvalidInputError, check_acceptance_method, in_range, one_of
from .adapter import stack_rows, strip_padding
from .wire import STEP, scalar, text

MAX_TOKEN_ID = 2**31 - 1  # token ids travel as int64 but every tree and model here takes int32 ids


def round_inputs(inps: list[StepInputs], release: bool) -> dict[str, np.ndarray]:
    """The inputs of a round's request to the step ensembles, one row per sequence (scalars [B, 1] in their wire dtype,
    :data:`~.wire.STEP`; ``token_ids`` [B, L] int64 padded with -1): what generate sends
    (:class:`~.triton_step.TritonStep`) and the in-process ensemble splits into rows
    (:class:`~.local_ensemble.LocalEnsemble`).

    Every round carries ``seeded`` (draft_model's and the verifier's: a seeded sampled row is verified by the coupled
    race); a round with a prompt being prefilled, ``num_scheduled_tokens`` (target_model's chunked prefill). A round in
    which some sequence drafts, and a release, carry ``num_draft_tokens`` and ``speculative_method`` for draft_model
    (``spec_step``), and, when a drafting row's proposer reads the target's hidden states,
    ``context_hidden_states`` [B, m, H] (rows zero-padded) with ``num_context_hidden_states`` [B, 1]; a round in which
    none drafts carries empty ``draft_token_ids`` [B, 0] and ``draft_probs`` [B, 0, 0] instead (``score_step``: no
    draft_model).
    """
    def col(name: str, values: list) -> np.ndarray:  # [B, 1] in the tensor's wire dtype (STEP)
        return np.array([[v] for v in values], STEP[name].numpy_dtype)

    params = [i.params for i in inps]
    out = {name: col(name, values) for name, values in (
        ("sequence_id", [i.seq_id for i in inps]),
        ("temperature", [p.temperature for p in params]),
        ("top_k", [p.top_k for p in params]),
        ("top_p", [p.top_p for p in params]),
        ("random_seed", [p.seed for p in params]),
        ("step", [i.step for i in inps]),
        ("release", [release] * len(inps)),
        ("acceptance_method", [i.acceptance_method.encode() for i in inps]),
        ("seeded", [p.seeded for p in params]))}  # also for the verifier: seeded rows are coupled (docs/verifier.md)
    out["token_ids"] = stack_rows([np.asarray(i.token_ids, STEP["token_ids"].numpy_dtype) for i in inps])
    if not release and any(i.num_scheduled_tokens for i in inps):
        out["num_scheduled_tokens"] = col("num_scheduled_tokens", [i.num_scheduled_tokens for i in inps])
    if not release and any(i.processors is not None for i in inps):
        out["logits_processors"] = col("logits_processors", [(i.processors.wire_text if i.processors else "").encode()
                                                             for i in inps])
    if release or any(i.drafts for i in inps):
        out["num_draft_tokens"] = col("num_draft_tokens", [i.num_draft_tokens for i in inps])
        out["speculative_method"] = col("speculative_method", [i.method.encode() for i in inps])
        hidden = [i.hidden_states if not release and i.drafts and needs_hidden_states(i.method) else None for i in inps]
        if any(h is not None and len(h) for h in hidden):
            width = next(h.shape[1] for h in hidden if h is not None and len(h))
            rows = [np.zeros((0, width), np.float32) if h is None else np.asarray(h, np.float32) for h in hidden]
            out["context_hidden_states"] = stack_rows(rows)
            out["num_context_hidden_states"] = col("num_context_hidden_states", [len(r) for r in rows])
    else:
        out["draft_token_ids"] = np.zeros((len(inps), 0), np.int64)
        out["draft_probs"] = np.zeros((len(inps), 0, 0), np.float32)
    return out


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
    hidden = context_hidden_states(inputs) if needs_hidden_states(method) else None
    return method, ProposalRequest(sequence_id(inputs), token_ids(inputs), k, sampling_params(inputs),
                                   int(scalar(inputs, "step", 0)), hidden, processor_spec(inputs))
