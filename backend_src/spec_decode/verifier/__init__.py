"""The verifier: rejection sampling (lossless) and typical acceptance, as Triton kernels (CUDA) and in torch (CPU)."""

from .greedy import argmax_suffices, argmax_walk
from .rejection import rejection_sample, typical_acceptance_sample, validate_inputs
from .verifier import Verifier, VerifierRow, VerifierSettings

__all__ = ["Verifier", "VerifierRow", "VerifierSettings", "argmax_suffices", "argmax_walk", "rejection_sample",
           "typical_acceptance_sample", "validate_inputs"]
