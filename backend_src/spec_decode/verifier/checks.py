"""Value checks shared by the verifier's two paths, so both raise the same ``ValueError`` for the same fault.

The torch path checks whole tensors before sampling (:func:`check_probabilities`, one ``aminmax`` pass per tensor)
and the sampled row after choosing it (:func:`check_sampled_rows`). The Triton kernels check every value they read
in the passes they already make over V and report per-row bit flags (:data:`BAD_TARGET`, :data:`BAD_DRAFT`,
:data:`ZERO_TARGET_ROW`), which :func:`raise_for_flags` turns into the same errors. The kernels check only what they
read, so for one input they may name fewer rows than the torch path, name the draft where the torch path names the
target (which it checks first), report a zero row where the torch path first reports an invalid value elsewhere, or
raise nothing when the bad value lies where no program reads it (after a row's first rejection), where it cannot
change the output.
"""

from __future__ import annotations

import torch

BAD_TARGET = 1  # a target probability read was NaN, +inf or negative
BAD_DRAFT = 2  # a draft probability read was NaN, +inf or negative
ZERO_TARGET_ROW = 4  # the target row sampled from (recovered, bonus or greedy token) sums to zero


def _rows(mask: torch.Tensor) -> list[int]:
    return torch.nonzero(mask.reshape(-1)).reshape(-1).tolist()


def invalid_values_error(name: str, rows: list[int]) -> ValueError:
    """The error for NaN, infinite or negative probabilities in ``name`` at batch rows ``rows``."""
    return ValueError(f"{name} contains NaN, infinite or negative probabilities (batch rows {rows}); "
                      "allowed: finite values >= 0")


def zero_row_error(rows: list[int]) -> ValueError:
    """The error for a target distribution that sums to zero where the verifier has to sample from it."""
    return ValueError(f"target_probs sums to zero at the position the verifier samples from (batch rows {rows}); "
                      "each position must be a distribution with positive total mass")


def check_probabilities(name: str, t: torch.Tensor | None) -> None:
    """Raise unless every entry of ``t`` ([B, ...], any float dtype, any device) is finite and >= 0.

    One pass over the tensor (min and max at once; NaN propagates into both, so ``min >= 0`` is False); only when
    that fails, a second pass per batch row finds the rows to name.

    Raises:
        ValueError: from :func:`invalid_values_error`, naming ``name`` and the batch rows at fault.
    """
    if t is None or t.numel() == 0:
        return
    lo, hi = torch.aminmax(t)
    if bool((lo >= 0) & (hi < float("inf"))):
        return
    lo, hi = torch.aminmax(t.reshape(t.shape[0], -1), dim=-1)
    raise invalid_values_error(name, _rows(~((lo >= 0) & (hi < float("inf")))))


def check_sampled_rows(p_n: torch.Tensor) -> None:
    """Raise when a row of ``p_n`` [B, V] (the target distribution each row samples its last token from) sums to zero.

    Raises:
        ValueError: from :func:`zero_row_error`.
    """
    ok = p_n.float().sum(-1) > 0
    if not bool(ok.all()):
        raise zero_row_error(_rows(~ok))


def raise_for_flags(flags: torch.Tensor) -> None:
    """Turn the kernels' per-row flags ([B] int32, any device; one host sync) into the torch path's errors.

    Raises:
        ValueError: invalid target values first, then invalid draft values, then a zero target row.
    """
    if not bool((flags != 0).any()):
        return
    flags = flags.cpu()
    if bool((flags & BAD_TARGET).any()):
        raise invalid_values_error("target_probs", _rows(flags & BAD_TARGET))
    if bool((flags & BAD_DRAFT).any()):
        raise invalid_values_error("draft_probs", _rows(flags & BAD_DRAFT))
    raise zero_row_error(_rows(flags & ZERO_TARGET_ROW))
