"""The registry: the proposers draft_model serves, by the ``speculative_method`` name clients send.

Adding a proposer is its own file (a :class:`~.base.Proposer` subclass with a ``name`` and, when it has config
parameters, its ``Settings``) plus one entry in :data:`PROPOSERS` (CONTRIBUTING.md, "Adding a proposer"). Everything
else reads this registry: the methods generate offers and checks requests against, draft_model's proposers and their
config parameters and gauges, the k schedule of a method.
"""

from __future__ import annotations

from collections.abc import Mapping

from ..protocol import AUTO, NO_SPECULATION
from ..scheduler.k_schedule import ConstantK, KSchedule
from .base import Proposer
from .draft_lm import DraftModelProposer
from .eagle import Eagle3Proposer, EagleProposer
from .hybrid import HybridProposer
from .ngram import NgramProposer
from .speculators.arctic import ArcticProposer
from .speculators.medusa import MedusaProposer
from .speculators.mlp import MLPSpeculatorProposer
from .suffix import SuffixProposer

# name -> class, in the order they are built and offered to clients: a proposer composed of others (hybrid) after
# those it composes.
PROPOSERS: dict[str, type[Proposer]] = {cls.name: cls for cls in (
    DraftModelProposer,
    NgramProposer,
    SuffixProposer,
    EagleProposer,
    Eagle3Proposer,
    MedusaProposer,
    MLPSpeculatorProposer,
    ArcticProposer,
    HybridProposer,
)}

METHODS: tuple[str, ...] = (NO_SPECULATION, *PROPOSERS)  # every method a request may name, served or not


def offered_methods(params: Mapping[str, str], draft_lm: bool | None = None) -> tuple[str, ...]:
    """The methods a server offers its clients: ``none`` and every registered proposer that draft_model serves with
    its config parameters ``params`` (:meth:`~.base.Proposer.configured`; nothing is loaded).

    Args:
        params: draft_model's config parameters (absent ones take their defaults).
        draft_lm: overrides whether the draft LM (``draft``) is served (generate's ``draft_model_available``).

    Raises:
        ValueError: a config parameter out of range (named).
    """
    out = [NO_SPECULATION]
    for name, cls in PROPOSERS.items():
        served = cls.configured(cls.Settings.from_params(params))
        if name == DraftModelProposer.name and draft_lm is not None:
            served = draft_lm
        if served:
            out.append(name)
    return tuple(out)


def build_proposers(params: Mapping[str, str]) -> dict[str, Proposer]:
    """draft_model's proposers from its config parameters: each registered class's ``Settings.from_params(params)``
    and ``from_config``; a class whose ``from_config`` returns None (the draft LM without a model) is not served.

    Raises:
        ValueError: a config parameter out of range (named).
        FileNotFoundError: a model folder that does not exist.
    """
    served: dict[str, Proposer] = {}
    for name, cls in PROPOSERS.items():
        proposer = cls.from_config(cls.Settings.from_params(params), served)
        if proposer is not None:
            served[name] = proposer
    return served


def config_parameters() -> set[str]:
    """Every config.pbtxt parameter key the registered proposers read."""
    return {key for cls in PROPOSERS.values() for key in cls.Settings.parameter_names()}


def k_schedule(method: str, configured: str, max_k: int) -> KSchedule:
    """How k changes from step to step for ``method`` (its proposer's :meth:`~.base.Proposer.k_schedule`; constant
    for ``none`` and ``auto``).

    Raises:
        KeyError: a method not in :data:`METHODS`.
    """
    if method in (NO_SPECULATION, AUTO):  # auto's controller chooses k itself
        return ConstantK()
    return PROPOSERS[method].k_schedule(configured, max_k)
