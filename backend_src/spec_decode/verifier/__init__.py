"""The verifier: rejection sampling (lossless) and typical acceptance, as Triton kernels (CUDA) and in torch (CPU), of
chains of drafts and of draft trees (:mod:`spec_decode.tree`)."""

from .greedy import argmax_suffices, argmax_walk
from .rejection import rejection_sample, typical_acceptance_sample, validate_inputs
from .tree_sampler import tree_rejection_sample, tree_typical_sample
from .verifier import Verifier, VerifierRow, VerifierSettings

__all__ = ["Verifier", "VerifierRow", "VerifierSettings", "argmax_suffices", "argmax_walk", "rejection_sample",
           "tree_rejection_sample", "tree_typical_sample", "typical_acceptance_sample", "validate_inputs"]
