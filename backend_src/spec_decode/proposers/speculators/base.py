"""What every published head shares: its config parameters, how it is found and loaded, and the hidden states it
reads (:class:`HeadProposer`)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, TypeVar

import torch
from torch import nn

from ...engine.model_loading import resolve_device, resolve_dtype, resolve_model_path
from ...settings import InvalidInputError, LMSettings, in_range
from ...tree import MAX_TREE_DEPTH, MAX_TREE_TOP_K
from ..base import ProposalRequest, Proposer
from .checkpoint import SpeculatorLoadError
from .layouts import served_heads
from .target import TargetInfo

M = TypeVar("M", bound=nn.Module)


@dataclass(frozen=True)
class SpeculatorSettings(LMSettings):
    """The heads' config parameters (draft_model): ``speculator_path``, ``speculator_min_token_prob``,
    ``target_model_path`` and, as for the draft LM, ``device``, ``dtype``, ``max_sequences``.

    Attributes:
        speculator_path: the head folders served, separated by commas: ``auto`` (the head ``make speculator`` trains,
            when built), or a folder in a published layout (:mod:`.layouts`); the method each serves is its layout's.
            ``""``/``none``: no head.
        speculator_min_token_prob: a step drafts its next slot while the product of its drafts' probabilities so far
            and the slot's top probability is >= this, in [0, 1]; 0 drafts every slot the head has (EAGLE-2's
            confidence; transformers' ``assistant_confidence_threshold``).
        target_model_path: the target's folder (its sizes, and the weights a head shares with it); ``""``: the one
            target_model serves (draft_model reads it from target_model's config.pbtxt), ``default``: the embedded
            model.
        medusa_choices: the tree a Medusa head drafts for a request that takes trees (``draft_tree``): ``dynamic``
            (the paths of its heads' top-k of highest joint probability), a published tree's name (``mc_sim_7b_63``)
            or a JSON list of paths of top-k indices (:mod:`.medusa.tree`).
        tree_top_k: the dynamic trees of the EAGLE, MLP and Arctic heads (``draft_tree``): children per expanded node
            and the frontier's width per level (EAGLE-2's ``top_k``, SGLang's ``--speculative-eagle-topk``), in
            [1, 10].
        tree_depth: their levels at most (EAGLE-2's ``depth``, SGLang's ``--speculative-num-steps``; 0: up to the
            request's node budget ``num_draft_tokens``), in [0, 64].
    """

    speculator_path: str = "auto"
    speculator_min_token_prob: float = 0.3
    target_model_path: str = ""
    medusa_choices: str = "dynamic"
    tree_top_k: int = 4
    tree_depth: int = 0

    def check(self) -> None:
        """As :meth:`~spec_decode.settings.LMSettings.check`, speculator_min_token_prob in [0, 1] and medusa_choices
        one :func:`~.medusa.tree.parse_choices` reads."""
        from .medusa.tree import parse_choices

        super().check()
        in_range("speculator_min_token_prob", self.speculator_min_token_prob, 0.0, 1.0)
        in_range("tree_top_k", self.tree_top_k, 1, MAX_TREE_TOP_K)
        in_range("tree_depth", self.tree_depth, 0, MAX_TREE_DEPTH)
        try:
            parse_choices(self.medusa_choices)
        except ValueError as exc:
            raise InvalidInputError("medusa_choices", str(exc).removeprefix("medusa_choices: ")) from None

    def target(self) -> TargetInfo:
        """The target's :class:`~.target.TargetInfo` (``""`` reads as ``default``).

        Raises:
            SpeculatorLoadError: its config does not read. FileNotFoundError: no such folder.
        """
        path = resolve_model_path(self.target_model_path or "default")
        assert path is not None  # "" and "none" read as the default
        return TargetInfo.from_folder(path)


class HeadProposer(Proposer):
    """Base of the proposers that serve a head from ``speculator_path``: the method ``name`` is the layout's
    (:data:`~.layouts.HEAD_METHODS`).

    Subclasses implement :meth:`load` (the head from its folder, checked against the target) and :meth:`propose`.
    The target's hidden states arrive as [m, H x (1 + A)] (:func:`~.layouts.aux_hidden_state_layers`): columns
    ``[0, H)`` are its last hidden state (after the final norm), what EAGLE-1, Medusa and the MLP speculators read.

    Args:
        head: what :meth:`load` returned, moved to the device and dtype.
        hidden_size: H, the target's hidden size.
        settings: the config parameters it was served with.
    """

    Settings: ClassVar[type[SpeculatorSettings]] = SpeculatorSettings  # type: ignore[assignment]
    needs_hidden_states = True
    applies_processors = True
    tree_widths = greedy_trees = True  # (Medusa's trees are for every request)

    def __init__(self, head: Any, hidden_size: int, settings: SpeculatorSettings):
        self.head, self.hidden_size = head, hidden_size
        self.min_token_prob = settings.speculator_min_token_prob
        self.tree_top_k, self.tree_depth = settings.tree_top_k, settings.tree_depth  # the chain heads' trees

    @classmethod
    def load(cls, folder: Path, target: TargetInfo) -> Any:  # pragma: no cover - abstract
        """The head in ``folder`` (an ``nn.Module``, float32 on the CPU), checked against ``target``.

        Raises:
            SpeculatorLoadError: naming the file and the key that does not fit.
        """
        raise NotImplementedError

    @classmethod
    def configured(cls, settings: SpeculatorSettings) -> bool:
        """Whether ``speculator_path`` names a head of this layout (an unreadable path: False; loading then fails
        with its error)."""
        return head_served(cls.name, settings)

    @classmethod
    def from_config(cls, settings: SpeculatorSettings, served) -> HeadProposer | None:
        """The head of this layout in ``speculator_path`` on the configured device and dtype, or None.

        Raises:
            SpeculatorLoadError: a folder that does not load (naming the file and key).
            ValueError: CUDA asked for but not available.
        """
        loaded = load_served_head(cls.name, settings, cls.load)
        if loaded is None:
            return None
        head, target = loaded
        return cls(place_head(head, settings).eval(), target.hidden_size, settings)

    def check(self, request: ProposalRequest) -> None:
        """A request's hidden states must be [m, H x (1 + A)] (A >= 0), m below the number of committed ids, and
        finite.

        Raises:
            InvalidInputError: naming ``context_hidden_states``.
        """
        check_hidden_states(request, self.hidden_size)

    @staticmethod
    def last_states(requests: list[ProposalRequest], hidden_size: int) -> tuple[list[int], torch.Tensor | None]:
        """The requests that bring hidden states, and their last ones' first H columns ([B, H] float32 on the CPU;
        None when no request brings any): the target's last hidden state at the position before the last committed
        token, the state that predicted that token."""
        live = [j for j, r in enumerate(requests) if r.hidden_states is not None and len(r.hidden_states)]
        if not live:
            return [], None
        states = torch.stack([requests[j].hidden_states[-1, :hidden_size] for j in live])  # type: ignore[index]
        return live, states.float()


def load_served_head(method: str, settings: SpeculatorSettings, load: Callable[[Path, TargetInfo], Any]
                     ) -> tuple[Any, TargetInfo] | None:
    """``load(folder, target)`` of the folder ``speculator_path`` serves for ``method`` (None when it serves none),
    with the target it was checked against (:meth:`SpeculatorSettings.target`).

    Raises:
        SpeculatorLoadError: a folder that does not load (naming the file and key).
    """
    path = served_heads(settings.speculator_path).get(method)
    if path is None:
        return None
    target = settings.target()
    return load(path, target), target


def place_head(head: M, settings: SpeculatorSettings) -> M:
    """``head`` moved to the configured ``device`` and ``dtype`` (:func:`~spec_decode.settings.resolve_device`).

    Raises:
        ValueError: CUDA asked for but not available.
    """
    device = resolve_device(settings.device)
    return head.to(device=device, dtype=resolve_dtype(settings.dtype, device))


def head_served(method: str, settings: SpeculatorSettings) -> bool:
    """Whether ``speculator_path`` names a head of ``method``, decided from config files alone (an unreadable path:
    False; loading then fails with its error)."""
    try:
        return method in served_heads(settings.speculator_path)
    except (SpeculatorLoadError, OSError):
        return False


def check_hidden_states(request: ProposalRequest, hidden_size: int) -> None:
    """Raise :class:`~spec_decode.settings.InvalidInputError` (``context_hidden_states``) unless the request's hidden
    states are absent or [m, H x (1 + A)] with m < len(token_ids), and finite."""
    h = request.hidden_states
    if h is None or not len(h):
        return
    if h.ndim != 2 or h.shape[1] % hidden_size or h.shape[0] >= len(request.token_ids):
        raise InvalidInputError("context_hidden_states", f"must be [m, {hidden_size} x n] (the target's hidden "
                                f"states at the m < {len(request.token_ids)} positions before the last token), got "
                                f"{list(h.shape)}")
    if not torch.isfinite(h).all():
        raise InvalidInputError("context_hidden_states", "must be finite")
