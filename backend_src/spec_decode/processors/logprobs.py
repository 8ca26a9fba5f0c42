"""Log-probs of emitted and prompt tokens: each token's own, its rank, and the top-N alternatives (vLLM's
``Logprob``: ``logprob`` and ``rank``, with N alternatives per position as its ``logprobs`` sampling parameter).

A step's emitted token j is drawn at position j of the step, whose distribution is exactly plain decoding's there
(the drafts before it were accepted), so the same rows give every emitted token's log-probs, not only the first's
(for a draft tree, the rows of the accepted path: ``step_logprobs(..., rows=tree.rows_of(path))``).
Which rows: ``logprobs_mode`` ``raw`` (vLLM's ``raw_logprobs``, its default: the target's log-softmax before any
processor, temperature, top-k or top-p) or ``processed`` (``processed_logprobs``: the log of the distribution the
token was sampled from, after all of them).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import numpy as np
import torch


class TokenLogprobs(NamedTuple):
    """Log-probs of n tokens.

    Attributes:
        log_probs: [n] each token's log-probability (natural log).
        ranks: [n] each token's 1-based rank in its position's distribution (1 = most probable; ties share the best).
        top_ids: [n][N] the N most probable token ids of each position, most probable first.
        top_log_probs: [n][N] their log-probabilities.
    """

    log_probs: list[float]
    ranks: list[int]
    top_ids: list[list[int]]
    top_log_probs: list[list[float]]


def token_logprobs(log_rows: torch.Tensor, token_ids: Sequence[int], top_n: int) -> TokenLogprobs:
    """Log-probs, ranks and top-N alternatives of ``token_ids[j]`` under row j of ``log_rows``.

    Args:
        log_rows: [>= n, V] log-probabilities (any float dtype, any device); row j is token j's distribution.
        token_ids: n token ids in [0, V).
        top_n: alternatives per token, >= 0 (at most V).

    Returns:
        :class:`TokenLogprobs` on the host.

    Raises:
        ValueError: fewer rows than tokens, or a token id outside [0, V).
    """
    n = len(token_ids)
    if log_rows.shape[0] < n:
        raise ValueError(f"token_logprobs: {log_rows.shape[0]} rows for {n} tokens")
    if n == 0:
        return TokenLogprobs([], [], [], [])
    rows = log_rows[:n].float()
    ids = torch.tensor(list(token_ids), dtype=torch.int64, device=rows.device)
    if int(ids.min()) < 0 or int(ids.max()) >= rows.shape[1]:
        raise ValueError(f"token_logprobs: token ids must lie in [0, {rows.shape[1]})")
    own = rows.gather(1, ids[:, None])  # [n, 1]
    ranks = (rows > own).sum(dim=1) + 1
    top = torch.topk(rows, min(top_n, rows.shape[1]), dim=1) if top_n > 0 else None
    return TokenLogprobs(own[:, 0].cpu().tolist(), ranks.cpu().tolist(),
                         top.indices.cpu().tolist() if top is not None else [[] for _ in range(n)],
                         top.values.cpu().tolist() if top is not None else [[] for _ in range(n)])


def step_logprobs(target_probs: torch.Tensor, log_rows: torch.Tensor | None, output_ids: Sequence[int],
                  top_n: int, rows: Sequence[int] | None = None) -> TokenLogprobs:
    """A step's emitted tokens' log-probs: from ``log_rows`` (``raw`` mode: the target's log-softmax rows) or, when
    None, from the log of ``target_probs`` (``processed``: the distributions the tokens were sampled from).

    Args:
        target_probs: [k+1, V] the step's processed target distributions.
        log_rows: [k+1, V] raw log-prob rows, or None.
        output_ids: the step's n <= k+1 emitted ids (accepted drafts, then the recovered or bonus token).
        top_n: alternatives per token (0..20).
        rows: the n target rows that predicted ``output_ids`` (a draft tree's accepted path,
            :func:`spec_decode.tree.rows_of`), each in [0, k]; None: the first n (a chain).

    Raises:
        ValueError: as :func:`token_logprobs`, or ``rows`` of another length than ``output_ids``.
        IndexError: a row outside the tensors.
    """
    n = len(output_ids)
    if rows is None:
        rows_t: torch.Tensor | slice = slice(0, n)
    else:
        if len(rows) != n:
            raise ValueError(f"step_logprobs: {len(rows)} rows for {n} tokens")
        src = log_rows if log_rows is not None else target_probs
        rows_t = torch.tensor([int(r) for r in rows], dtype=torch.int64, device=src.device)
    picked = log_rows[rows_t] if log_rows is not None else torch.log(target_probs[rows_t].float())
    return token_logprobs(picked, output_ids, top_n)


def logprob_arrays(t: TokenLogprobs | None, ids_dtype: type = np.int64,
                   width: int | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """n tokens' log-probs as the arrays that carry them on the wire: (log-probs [n] float32, ranks [n], top log-probs
    [n, N] float32, top ids [n, N]), ranks and ids in ``ids_dtype``; N is ``width``, else the rows' own (0 when there
    are none). None gives empty arrays."""
    t = t or TokenLogprobs([], [], [], [])
    n = len(t.top_ids)  # one row of alternatives per token, empty rows when none were asked for
    if width is None:
        width = len(t.top_ids[0]) if t.top_ids else 0
    return (np.asarray(t.log_probs, np.float32), np.asarray(t.ranks, ids_dtype),
            np.asarray(t.top_log_probs, np.float32).reshape(n, width),
            np.asarray(t.top_ids, ids_dtype).reshape(n, width))
