"""The Medusa head (Cai et al. 2024, FasterDecoding/Medusa): n heads of L residual blocks and a projection each over
the target's last hidden state (the package's docstring gives the maths and the published layouts)."""

from __future__ import annotations

from typing import cast

import torch
import torch.nn.functional as F
from torch import nn


class MedusaHead(nn.Module):
    """n Medusa heads over the target's last hidden state.

    Head i: ``num_layers`` residual blocks ``x <- x + SiLU(Linear(x))`` (FasterDecoding's ``ResBlock``, vLLM's
    ``ResidualBlock``), then a projection to the vocabulary without bias (its own, or one shared by every head: vLLM's
    ``original_lm_head``). With a ``token_map`` (vLLM's ``truncated_vocab_size``) the projection covers only the
    mapped ids and every other id gets -inf.

    Args:
        hidden_size: H.
        vocab_size: V, the target's vocabulary.
        num_heads: n >= 1.
        num_layers: residual blocks per head, L >= 0.
        bias: whether the blocks' linears have a bias (FasterDecoding: always; vLLM: ``medusa_fc_bias``).
        shared_lm_head: one projection for every head (``original_lm_head``).
        token_map: [V'] int64 distinct ids in [0, V) the projections' rows stand for, or None (V' = V).
        logit_scale: factor on the logits (vLLM's ``logit_scale``; 1.0 otherwise).

    Weights are zero-initialised: :func:`~.published.load_medusa` fills them.
    """

    def __init__(self, hidden_size: int, vocab_size: int, num_heads: int, num_layers: int, bias: bool = True,
                 shared_lm_head: bool = False, token_map: torch.Tensor | None = None, logit_scale: float = 1.0):
        super().__init__()
        self.hidden_size, self.vocab_size, self.num_heads, self.num_layers = hidden_size, vocab_size, num_heads, \
            num_layers
        self.logit_scale = float(logit_scale)
        rows = vocab_size if token_map is None else len(token_map)
        self.blocks = nn.ModuleList(nn.ModuleList(nn.Linear(hidden_size, hidden_size, bias=bias)
                                                  for _ in range(num_layers)) for _ in range(num_heads))
        self.lm_heads = nn.ModuleList(nn.Linear(hidden_size, rows, bias=False)
                                      for _ in range(1 if shared_lm_head else num_heads))
        self.token_map: torch.Tensor | None
        self.register_buffer("token_map", None if token_map is None else token_map.long().clone())
        for p in self.parameters():
            nn.init.zeros_(p)

    def forward(self, states: torch.Tensor, heads: int | None = None) -> torch.Tensor:
        """The heads' logits.

        Args:
            states: [B, H] the target's last hidden states (any float dtype and device; moved to the head's).
            heads: compute only the first ``heads`` heads (None: all n).

        Returns:
            [heads, B, V] float32 logits on the head's device (-inf at the ids a ``token_map`` leaves out).
        """
        ref = next(self.lm_heads.parameters())
        x0 = states.to(device=ref.device, dtype=ref.dtype)
        out = []
        for i in range(self.num_heads if heads is None else min(heads, self.num_heads)):
            x = x0
            for linear in cast(nn.ModuleList, self.blocks[i]):
                x = x + F.silu(linear(x))
            logits = self.lm_heads[0 if len(self.lm_heads) == 1 else i](x).float()
            if self.logit_scale != 1.0:
                logits = logits * self.logit_scale
            if self.token_map is not None:
                full = logits.new_full((logits.shape[0], self.vocab_size), float("-inf"))
                full[:, self.token_map] = logits
                logits = full
            out.append(logits)
        return torch.stack(out)
