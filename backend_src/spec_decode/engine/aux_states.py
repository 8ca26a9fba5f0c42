"""The target's auxiliary hidden states: the inputs of chosen decoder layers, which an EAGLE-3 head drafts from.

EAGLE-3 (Li et al. 2025, arXiv 2503.01840) reads three of the target's layers rather than its last one; vLLM returns
them as ``aux_hidden_states`` (the residual stream entering each named layer, ``model_executor/models/llama.py``).
:class:`AuxHiddenStates` captures the same tensors with forward pre-hooks on those layers, so the decoder's forward is
unchanged and nothing else is kept. Id L (one past the last layer) is the last layer's output before the final norm,
the input of the decoder's ``norm`` (heads that name it: ``nvidia/gpt-oss-120b-Eagle3-v3``'s [24, 30, 36] of 36
layers, SGLang PR #32334).
"""

from __future__ import annotations

import weakref

import torch
from torch import nn


def _remove(handles: list) -> None:
    """Remove forward-hook ``handles`` (``torch.utils.hooks.RemovableHandle``)."""
    for h in handles:
        h.remove()


class AuxHiddenStates:
    """Forward pre-hooks on a decoder's layers ``layers`` that keep each one's input of the latest forward.

    Args:
        decoder: a transformers decoder (``*Model``) with ``layers`` (an ``nn.ModuleList`` of L decoder layers) and,
            for id L, its final ``norm``.
        layers: layer ids in [0, L], distinct (L: the input of the final norm); empty: no hooks, :meth:`gather`
            returns its input.

    Raises:
        ValueError: an id out of range or repeated, or a decoder without ``layers``.
    """

    def __init__(self, decoder: nn.Module, layers: list[int]):
        stack = getattr(decoder, "layers", None)
        if layers and not isinstance(stack, nn.ModuleList):
            raise ValueError("the target's decoder has no `layers` to read auxiliary hidden states from")
        n = len(stack) if isinstance(stack, nn.ModuleList) else 0
        if len(set(layers)) != len(layers) or any(not 0 <= i <= n for i in layers):
            raise ValueError(f"auxiliary hidden-state layers must be distinct ids in [0, {n}], got {layers}")
        norm = getattr(decoder, "norm", None)
        if n in layers and not isinstance(norm, nn.Module):
            raise ValueError(f"auxiliary hidden-state layer {n} (the last layer's output) needs the decoder's final "
                             f"`norm`, which this decoder does not have")
        self.layers = list(layers)
        self._latest: dict[int, torch.Tensor] = {}
        handles = []
        for i in self.layers:
            assert isinstance(stack, nn.ModuleList)
            module = stack[i] if i < n else norm
            assert isinstance(module, nn.Module)
            handles.append(module.register_forward_pre_hook(self._hook(weakref.ref(self), i), with_kwargs=True))
        # the hooks hold no reference to this object: when it goes (with the cache built on the model), they go too
        weakref.finalize(self, _remove, handles)

    @staticmethod
    def _hook(owner: weakref.ref, i: int):
        def keep(_module, args, kwargs):
            aux = owner()
            if aux is not None:
                aux._latest[i] = args[0] if args else kwargs["hidden_states"]
        return keep

    def gather(self, hidden: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        """The last hidden states ``hidden`` [B, O, H] of the forward just run (already gathered at the query columns
        ``index`` [B, O]), followed by each layer's input at the same columns: [B, O, H x (1 + len(layers))]
        (``hidden`` itself when there are no layers)."""
        if not self.layers:
            return hidden
        parts = [hidden]
        for i in self.layers:
            x = self._latest.pop(i)
            parts.append(x.gather(1, index[:, :, None].expand(-1, -1, x.shape[-1])).to(hidden.dtype))
        return torch.cat(parts, -1)
