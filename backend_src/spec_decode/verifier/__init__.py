"""The verifier: accepts a prefix of the draft tokens (rejection sampling, lossless; typical acceptance, approximate).

Public API: :func:`rejection_sample` and :func:`typical_acceptance_sample` (:mod:`.rejection`), and :class:`Verifier`
(:mod:`.verifier`), which verifies a round of sequences with the configured acceptance method in one sampler call per
kind of row. CUDA tensors run the Triton kernels of :mod:`.kernels`; CPU tensors the torch maths of
:mod:`.torch_impl`.
"""

from .rejection import rejection_sample, typical_acceptance_sample, validate_inputs
from .verifier import Verifier, VerifierRow, VerifierSettings

__all__ = ["Verifier", "VerifierRow", "VerifierSettings", "rejection_sample", "typical_acceptance_sample",
           "validate_inputs"]
