"""Batch-invariant attention for the CPU: every query row's output computed by the same operations, in the same order,
whatever the number of query rows in the forward and whatever the keys past the row's own position.

Why: speculative greedy decoding is lossless only if scoring k+1 positions in one forward gives each position the
logits that plain decoding (one position per forward) gives it. PyTorch's CPU ``scaled_dot_product_attention`` does not
as called: its flash kernel cuts the keys into blocks of 512 and runs the last, shorter block's sums in another order,
and its matrix products take another kernel for fewer rows (in bfloat16 a logit moved by up to ~1 between one forward
of 5 positions and five of one, enough to change the argmax on a few percent of steps). The cure follows "Defeating
Nondeterminism in LLM Inference" (Horace He and Thinking Machines Lab, 2025): fixed reduction blocks whatever the
batch.

Here the same kernel runs on padded inputs: the keys (and the mask) are padded with masked positions to a multiple of
:data:`KEY_BLOCK` (the CPU kernel's key block, so every block is full and a row's blocks past its own keys add exact
zeros), and the query rows with zero rows to at least :data:`MIN_ROWS` (below 8 rows the CPU's GEMMs switch kernels).
Measured on AVX-512 BF16 (torch 2.13): 0 of 108 rows differ in float32 and bfloat16 between a forward of 2-192
positions and one position at a time, against 108 and 16 of 108 without padding. The linear layers need one more rule
(:data:`MIN_ROWS_LINEAR`), which the engine's round shapes apply. :func:`~.dtype_choice.kernels_batch_invariant`
checks the kernels on the machine it runs on, and :func:`~.dtype_choice.probe_forward` a loaded model's forward.

A draft tree (:mod:`spec_decode.tree`) needs one more rule. Under the tree mask a node's visible keys are the context
and its ancestors' slots, with its cousins' slots masked in between; a masked key still shifts which SIMD lane and
which partial sum each later key falls into, so the node's output would differ in the last bits from the same token
scored in a chain (measured on the embedded model: up to 0.375 in a logit). So a tree round passes its root-to-leaf
paths (:class:`TreePaths`, built by :func:`~.paged_forward.tree_paths`), and each path's queries attend to the context
and that path's own slots laid out contiguously, exactly as a chain of those tokens: a node's output is plain
decoding's, bit for bit. A node on several paths is computed on each (alike) and taken from its first.

Registered with transformers' ``AttentionInterface`` as :data:`NAME`; :func:`use_invariant_attention` switches a loaded
model to it.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

NAME = "spec_decode_invariant"
KEY_BLOCK = 512  # PyTorch's CPU flash attention's key block (kvSplitSize): keys padded to a multiple of it
MIN_ROWS = 16  # query rows of the attention at least (zero rows added), where its products keep one kernel
# rows of every linear layer's product at least: oneDNN's bfloat16 GEMM takes another kernel for one row (measured on
# AVX-512 BF16: a one-row product of 1,536 -> 576 differs in the last bit from the same row among others)
MIN_ROWS_LINEAR = 2


class TreePaths(NamedTuple):
    """A tree round's root-to-leaf paths, for the attention of the batch-invariant forward (module docstring). P paths
    of at most M new tokens each, on the round's device, int64.

    Attributes:
        row: [P] the round row of each path.
        cols: [P, M] the path's new-token columns in depth order (padding repeats the last).
        keys: [P, L'] the key positions the path reads, in order: the row's context, then its columns' slots
            (padding: 0, masked).
        context: [P] the row's cached context (keys before the path's first column).
        take: [B, Q] for each query (row, column) the flat index ``p * M + i`` of the path entry that computes it.
    """

    row: torch.Tensor
    cols: torch.Tensor
    keys: torch.Tensor
    context: torch.Tensor
    take: torch.Tensor


def _padded_sdpa(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask: torch.Tensor,
                 scaling: float | None) -> torch.Tensor:
    """SDPA on inputs padded to :data:`MIN_ROWS` query rows and a multiple of :data:`KEY_BLOCK` keys; [B, Q, H, D]."""
    b, h, q, d = query.shape
    length = key.shape[2]
    rows, keys = max(q, MIN_ROWS), -(-length // KEY_BLOCK) * KEY_BLOCK
    mask = F.pad(attention_mask.expand(b, 1, q, length), (0, keys - length), value=torch.finfo(query.dtype).min)
    mask = F.pad(mask, (0, 0, 0, rows - q))  # a padded query row sees every real key: never an empty softmax
    out = F.scaled_dot_product_attention(F.pad(query, (0, 0, 0, rows - q)), F.pad(key, (0, 0, 0, keys - length)),
                                         F.pad(value, (0, 0, 0, keys - length)), attn_mask=mask, scale=scaling,
                                         enable_gqa=h != key.shape[1])
    return out[:, :, :q].transpose(1, 2).contiguous()


def _path_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, paths: TreePaths,
                    scaling: float | None) -> torch.Tensor:
    """Each path's queries over the context and the path's own keys, contiguous (module docstring); [B, Q, H, D]."""
    b, h, q, d = query.shape
    m = paths.cols.shape[1]
    qp = query.transpose(1, 2)[paths.row[:, None], paths.cols].transpose(1, 2)  # [P, H, M, D]
    kp = key.transpose(1, 2)[paths.row[:, None], paths.keys].transpose(1, 2)  # [P, KVH, L', D]
    vp = value.transpose(1, 2)[paths.row[:, None], paths.keys].transpose(1, 2)
    depth = torch.arange(m, device=query.device)
    kpos = torch.arange(paths.keys.shape[1], device=query.device)
    seen = kpos[None, None, :] <= (paths.context[:, None] + depth[None, :])[:, :, None]  # [P, M, L']
    mask = torch.where(seen, 0.0, torch.finfo(query.dtype).min).to(query.dtype)[:, None]
    out = _padded_sdpa(qp, kp, vp, mask, scaling)  # [P, M, H, D]
    return out.reshape(-1, h, d)[paths.take.reshape(-1)].reshape(b, q, h, d)


def invariant_attention(module: torch.nn.Module | None, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                        attention_mask: torch.Tensor | None, scaling: float | None = None, dropout: float = 0.0,
                        tree_paths: TreePaths | None = None, **kwargs) -> tuple[torch.Tensor, None]:
    """``scaled_dot_product_attention`` on padded inputs (module docstring), with transformers' attention-function
    signature.

    Args:
        module: the attention layer (unused beyond its signature; None outside a model).
        query: [B, H, Q, D] (model dtype).
        key, value: [B, KVH, L, D]; H a multiple of KVH (grouped-query attention). Finite everywhere (a masked key's
            weight is 0, and 0 x NaN would still be NaN).
        attention_mask: additive [B or 1, 1, Q, L] in the query's dtype (0 where a key is seen, a large negative value
            where not; the engine's paged forward builds it), or None: every key seen.
        scaling: the scores' factor (default D ** -0.5).
        dropout: must be 0 (inference only).
        tree_paths: a tree round's paths (:class:`TreePaths`): each path attended to as a chain (module docstring);
            ``attention_mask`` is then not read.

    Returns:
        ([B, Q, H, D] in the query's dtype, None): transformers' layout, before the output projection.

    Raises:
        ValueError: ``dropout`` > 0.
    """
    if dropout:
        raise ValueError("invariant_attention runs inference only (dropout must be 0)")
    if tree_paths is not None:
        return _path_attention(query, key, value, tree_paths, scaling), None
    q, length = query.shape[2], key.shape[2]
    if attention_mask is None:
        attention_mask = torch.zeros(1, 1, q, length, dtype=query.dtype, device=query.device)
    return _padded_sdpa(query, key, value, attention_mask, scaling), None


def register() -> None:
    """Register :func:`invariant_attention` with transformers under :data:`NAME` (and its mask builder as SDPA's:
    the engine passes its own 4D mask). Idempotent."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(NAME, invariant_attention)
    AttentionMaskInterface.register(NAME, sdpa_mask)


def use_invariant_attention(model) -> None:
    """Switch a loaded transformers model (a ``PreTrainedModel``, and its sub-configs) to
    :func:`invariant_attention`."""
    register()
    model.set_attn_implementation(NAME)


__all__ = ["KEY_BLOCK", "MIN_ROWS", "MIN_ROWS_LINEAR", "NAME", "TreePaths", "invariant_attention", "register",
           "use_invariant_attention"]
