"""Published speculator checkpoints, loaded as their authors publish them: detection (:mod:`.layouts`), reading and
checking a folder (:mod:`.checkpoint`), what a head must fit in the target (:mod:`.target`), whether the heads served
fit it, checked before anything starts (:mod:`.fit`), and the proposers' shared base (:mod:`.base`). The EAGLE heads'
proposers live in :mod:`spec_decode.proposers.eagle`."""

from .base import HeadProposer, SpeculatorSettings, check_hidden_states
from .checkpoint import SpeculatorLoadError
from .fit import HeadFitError, check_heads_fit
from .layouts import HEAD_METHODS, aux_hidden_state_layers, detect, eagle3_layer_ids, served_heads
from .target import TargetInfo

__all__ = ["HEAD_METHODS", "HeadFitError", "HeadProposer", "SpeculatorLoadError", "SpeculatorSettings", "TargetInfo",
           "aux_hidden_state_layers", "check_heads_fit", "check_hidden_states", "detect", "eagle3_layer_ids",
           "served_heads"]
