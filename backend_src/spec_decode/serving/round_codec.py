"""A round on the wire: how generate encodes a round of steps as one batched request, and how a round's outputs are
decoded into each step's :class:`~spec_decode.protocol.StepResult`.

The round's shape is that of vLLM's ``SpecDecodeMetadata``: per row, the committed ids, k' draft ids and, for a draft
tree, each draft's parent (``draft_parents``: -1 for a child of the last committed token; a chain is
``[-1, 0, 1, ...]``; :mod:`spec_decode.tree`); the target scores k'+1 rows per sequence and the verifier emits the
accepted path's tokens and one more. Rows are stacked on the batch dimension (one sequence per row, so each step model
gets the whole round in one ``execute``), and what a padded or empty row means is fixed here, once:

- Token-id tensors (``token_ids``, ``draft_token_ids``, ``output_ids``, argmax ids) are padded at the end with
  ``PAD_ID`` (-1), never a token id: a row's ids are the row without its trailing -1s (:func:`~.adapter.strip_padding`).
- ``draft_parents`` is padded with -1 too, which IS a parent (the root): a row's parents are its first k' entries, k'
  its drafts' count, never the row stripped of -1s. Absent or empty: a chain.
- Float tensors (probabilities, log-probs, hidden states) are padded with 0. A row the target scored nothing for (a
  prompt chunk) has no output ids: an empty ``output_ids`` row (all -1) commits nothing but the chunk.
- Per-row scalars travel as [B, 1] in their wire dtype (:data:`~.wire.STEP`).

Shared by the Triton transport (:mod:`.triton_step`) and the in-process ensemble (:mod:`.local_ensemble`); the
in-process transport (:mod:`spec_decode.in_process`) builds its results with the same
:func:`~spec_decode.protocol.step_result`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from ..processors import TokenLogprobs
from ..protocol import StepInputs, StepResult, step_result
from ..tree import chain_parents, is_chain
from .adapter import stack_rows, strip_padding
from .step_inputs import needs_hidden_states
from .wire import PROMPT_LOGPROB_OUTPUTS, STEP

# the emitted ids' ranks and alternatives, as the round's outputs name them
LOGPROB_OUTPUTS = ("output_token_ranks", "top_log_probs", "top_log_prob_ids")
TARGET_FACTS = ("num_cached_tokens", "target_forward_seconds")  # StepResult.cached_tokens, .forward_seconds


def encode_round(inps: list[StepInputs], release: bool) -> dict[str, np.ndarray]:
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
    draft_model). A drafting round in which some row may draft a tree carries ``draft_tree`` [B, 1], and
    ``tree_top_k`` / ``tree_depth`` [B, 1] when some row sets them (0: draft_model's config).
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
        if not release and any(i.draft_tree for i in inps):
            out["draft_tree"] = col("draft_tree", [i.draft_tree for i in inps])
            for name in ("tree_top_k", "tree_depth"):  # a shape a request (or auto) chose
                if any(getattr(i, name) for i in inps):
                    out[name] = col(name, [getattr(i, name) for i in inps])
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


def row_parents(parents: np.ndarray | None, k: int) -> list[int] | None:
    """A row's draft parents from its padded ``draft_parents`` row: the first ``k`` entries (k = its drafts), or None
    for a chain (absent, empty, or ``[-1, 0, 1, ...]``)."""
    if parents is None or k == 0 or parents.size < k:
        return None
    out = parents.reshape(-1)[:k].astype(np.int64).tolist()
    return None if is_chain(out) else out


@dataclass(frozen=True)
class RoundDrafts:
    """A round's drafts, flat, in the manner of vLLM's ``SpecDecodeMetadata``: every row's draft ids one after the
    other, the count per row, and every draft's parent (a chain's ``[-1, 0, 1, ...]`` spelled out), decoded once from
    the round's padded ``draft_token_ids`` / ``draft_parents`` (module docstring).

    Attributes:
        draft_token_ids: [sum k] int64. num_draft_tokens: [B] int64 (k' per row).
        parents: [sum k] int64, each draft's parent among its own row's drafts (-1: the last committed token).
    """

    draft_token_ids: np.ndarray
    num_draft_tokens: np.ndarray
    parents: np.ndarray

    @staticmethod
    def decode(rows: int, draft_token_ids: np.ndarray | None, draft_parents: np.ndarray | None) -> RoundDrafts:
        """From a round's padded outputs ([B, k] each; None: no drafts, or chains). A row's drafts are its ids
        without their trailing -1s; its parents the first k' entries of its parents row."""
        ids, counts, parents = [], [], []
        padded = None if draft_token_ids is None else np.asarray(draft_token_ids).reshape(rows, -1)
        par = None if draft_parents is None else np.asarray(draft_parents).reshape(rows, -1)
        for row in range(rows):
            drafts = [] if padded is None else strip_padding(padded[row])
            tree = None if par is None else row_parents(par[row], len(drafts))
            ids += drafts
            counts.append(len(drafts))
            parents += chain_parents(len(drafts)) if tree is None else tree
        return RoundDrafts(np.asarray(ids, np.int64), np.asarray(counts, np.int64), np.asarray(parents, np.int64))

    def row(self, i: int) -> tuple[list[int], list[int] | None]:
        """Row ``i``'s (draft ids, parents: None for a chain)."""
        start = int(self.num_draft_tokens[:i].sum())
        end = start + int(self.num_draft_tokens[i])
        parents = self.parents[start:end].tolist()
        return self.draft_token_ids[start:end].tolist(), None if is_chain(parents) else parents


def _logprobs(names: tuple[str, ...], outputs: Mapping, row: int, n: int, top_n: int,
              log_probs: list[float]) -> TokenLogprobs:
    """Row ``row``'s first ``n`` (ranks, top log-probs, top ids) of the round's outputs ``names``, padding cut."""
    ranks, top_lps, top_ids = (outputs[name] for name in names)
    return TokenLogprobs(list(log_probs[:n]), ranks[row, :n].astype(int).tolist(),
                         top_ids[row, :n, :top_n].astype(int).tolist(), top_lps[row, :n, :top_n].tolist())


def decode_results(inps: list[StepInputs], outputs: Mapping[str, np.ndarray | None]) -> list[StepResult]:
    """Each step's result from a round's stacked outputs (host arrays by wire name, [B, ...], padded as the module
    docstring says; a name absent or None: the round did not ask for it).

    Args:
        inps: the round's steps, one per row.
        outputs: ``output_ids`` and ``output_log_probs`` [B, n]; optionally ``draft_token_ids`` and ``draft_parents``
            [B, k], ``hidden_states`` [B, k+1, H] (every scored row), :data:`TARGET_FACTS` [B, 1],
            :data:`LOGPROB_OUTPUTS` and :data:`PROMPT_LOGPROB_OUTPUTS`.

    Raises:
        ValueError: a row's emitted ids that do not follow its drafts.
    """
    get = outputs.get
    rows = len(inps)
    ids_out = np.asarray(get("output_ids")).reshape(rows, -1)
    lps_out = np.asarray(get("output_log_probs")).reshape(rows, -1)
    meta = RoundDrafts.decode(rows, get("draft_token_ids"), get("draft_parents"))
    hidden = get("hidden_states")
    cached, forward = (get(name) for name in TARGET_FACTS)
    out = []
    for row, inp in enumerate(inps):
        ids = strip_padding(ids_out[row])
        n = len(ids)
        drafts, tree = meta.row(row)
        h = None if hidden is None or np.ndim(hidden) != 3 else np.array(hidden[row], np.float32)
        lps = lps_out[row, :n].tolist()
        spec = inp.processors
        asked = None
        if spec is not None and spec.logprobs and get(LOGPROB_OUTPUTS[0]) is not None:
            asked = _logprobs(LOGPROB_OUTPUTS, outputs, row, n, spec.top_logprobs, lps)
        prompt = None
        if spec is not None and inp.wants_prompt_logprobs and get(PROMPT_LOGPROB_OUTPUTS[0]) is not None:
            n_prompt = len(inp.token_ids) - 1
            prompt = _logprobs(PROMPT_LOGPROB_OUTPUTS[1:], outputs, row, n_prompt, spec.prompt_logprobs,
                               np.asarray(get(PROMPT_LOGPROB_OUTPUTS[0]))[row, :n_prompt].tolist())
        c, f = None, None
        if cached is not None and forward is not None:
            c, f = int(np.asarray(cached).reshape(-1)[row]), float(np.asarray(forward).reshape(-1)[row])
        out.append(step_result(inp, ids, lps, drafts, tree, h, asked, prompt, c, f))
    return out


__all__ = ["LOGPROB_OUTPUTS", "TARGET_FACTS", "RoundDrafts", "decode_results", "encode_round", "row_parents"]
